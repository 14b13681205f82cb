"""The Triton LoRA kernels on the GPU: the interpreter's cases (tests/unit/test_lora_triton.py)
and Llama-3.1-8B's projections at batch 64 over 8 slots of rank 16 in bf16, against the
torch path and float64; and a tiny model's engine on CUDA with the Triton path equal, token
for token, to the same engine with the torch path (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_lora_triton import SMALL_CASES, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# name: (tokens, in, sub-module sizes, slot rank, slots, dtype) at Llama-3.1-8B's widths.
CASES_8B = {
    "qkv_b64": (64, 4096, [4096, 1024, 1024], 16, 8, "bfloat16"),
    "o_b64": (64, 4096, [4096], 16, 8, "bfloat16"),
    "gate_up_b64": (64, 4096, [14336, 14336], 16, 8, "bfloat16"),
    "down_b64": (64, 14336, [4096], 16, 8, "bfloat16"),
    "qkv_prefill_512": (512, 4096, [4096, 1024, 1024], 16, 8, "bfloat16"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return run_cases(SMALL_CASES | CASES_8B, "cuda")


@pytest.mark.parametrize(
    "name", [f"{c}/{p}" for c in SMALL_CASES | CASES_8B for p in ("triton", "torch", "base_rows")]
)
def test_lora_kernels_on_gpu(results: dict[str, float], name: str) -> None:
    assert results[name] <= 1.0, f"{name}: error {results[name]:.3g} x the bound"


def test_engine_triton_path_equals_torch_path(tmp_path: Path) -> None:
    from engine import LLM, LoRARequest, SamplingParams
    from tests.lora_fixtures import make_adapter
    from tests.model_fixtures import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=i, r=8) for i in range(3)]
    llm = LLM(str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8)  # fmt: skip
    prompts = [[1, *range(300 + 17 * i, 340 + 17 * i)] for i in range(8)]
    loras = [
        None if i % 4 == 3 else LoRARequest(f"a{i % 4}", 1, str(adapters[i % 4])) for i in range(8)
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    slots = llm.engine.lora.slots
    assert slots.use_triton
    triton_out = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
    slots.use_triton = False
    llm.engine.reset_prefix_cache()
    torch_out = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
    assert triton_out == torch_out
