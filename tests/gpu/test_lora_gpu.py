"""The Triton LoRA kernels on the GPU: the interpreter's cases (tests/unit/test_lora_triton.py)
and Llama-3.1-8B's projections at batch 64 over 8 slots of rank 16 in bf16, against the
torch path and float64; and a tiny model's engine on CUDA with the Triton path equal, token
for token, to the same engine with the torch path (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_lora_triton import SMALL_CASES, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# name: (tokens, in, sub-module sizes, slot rank, slots, dtype, shrink programs) at
# Llama-3.1-8B's widths; 0 programs: the engine's default (twice the GPU's SMs).
CASES_8B = {
    "qkv_b64": (64, 4096, [4096, 1024, 1024], 16, 8, "bfloat16", 0),
    "o_b64": (64, 4096, [4096], 16, 8, "bfloat16", 0),
    "gate_up_b64": (64, 4096, [14336, 14336], 16, 8, "bfloat16", 0),
    "down_b64": (64, 14336, [4096], 16, 8, "bfloat16", 0),
    "down_b64_whole_k": (64, 14336, [4096], 16, 8, "bfloat16", 1),
    "qkv_prefill_512": (512, 4096, [4096, 1024, 1024], 16, 8, "bfloat16", 0),
    "gate_up_prefill_2048_one_slot": (2048, 4096, [14336, 14336], 16, 1, "bfloat16", 0),
}


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return run_cases(SMALL_CASES | CASES_8B, "cuda")


@pytest.mark.parametrize(
    "name", [f"{c}/{p}" for c in SMALL_CASES | CASES_8B for p in ("triton", "torch", "base_rows")]
)
def test_lora_kernels_on_gpu(results: dict[str, float], name: str) -> None:
    assert results[name] <= 1.0, f"{name}: error {results[name]:.3g} x the bound"


def _replays(graphs: Any) -> int:
    return -1 if graphs is None else int(graphs.num_replays)


def _triton_vs_torch(tmp_path: Path, **engine: Any) -> dict[str, Any]:
    """A tiny model's engine on CUDA, three adapters and the base in one batch: greedy
    tokens with the Triton path (graphs with the LoRA kernels, where the engine has
    graphs) and with the torch path (eager), and the replays of the LoRA graphs during
    the Triton run (-1: no such graphs)."""
    from engine import LLM, LoRARequest, SamplingParams
    from tests.lora_fixtures import make_adapter
    from tests.model_fixtures import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=i, r=8) for i in range(3)]
    llm = LLM(str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8, **engine)  # fmt: skip
    prompts = [[1, *range(300 + 17 * i, 340 + 17 * i)] for i in range(8)]
    loras = [
        None if i % 4 == 3 else LoRARequest(f"a{i % 4}", 1, str(adapters[i % 4])) for i in range(8)
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    slots, runner = llm.engine.lora.slots, llm.engine.runner
    assert slots.use_triton
    out: dict[str, Any] = {}
    try:
        out["triton"] = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
        out["decode_replays"] = _replays(runner.lora_graphs)
        out["mixed_replays"] = _replays(runner.lora_mixed_graphs)
        slots.use_triton = False
        llm.engine.reset_prefix_cache()
        out["torch"] = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
    finally:
        llm.shutdown()
    return out


def test_engine_triton_path_equals_torch_path(tmp_path: Path) -> None:
    """Decode steps with adapter tokens replay the decode graphs recorded with the LoRA
    kernels; their tokens equal the eager torch path's."""
    out = _triton_vs_torch(tmp_path, attention_backend="triton")
    assert out["triton"] == out["torch"]
    assert out["decode_replays"] > 0, out


def test_lora_graphs_replay_decode_and_mixed_steps(tmp_path: Path) -> None:
    """With mixed-step graphs on, prefill steps with adapter tokens replay the mixed
    graphs recorded with the LoRA kernels (and decode steps the decode ones); the tokens
    equal the eager torch path's."""
    out = _triton_vs_torch(
        tmp_path, attention_backend="triton", mixed_cuda_graphs=True, mixed_graph_max_tokens=512,
        max_num_batched_tokens=96,  # prompt chunks beside decodes
    )  # fmt: skip
    assert out["triton"] == out["torch"]
    assert out["decode_replays"] > 0 and out["mixed_replays"] > 0, out
