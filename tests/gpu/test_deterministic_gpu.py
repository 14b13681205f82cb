"""Deterministic mode on the GPU (docs/design.md §3 "Deterministic mode"): batch 1 vs
batch 64 give bit-identical results.

- ``bi_linear`` at Llama-3.1-8B's projection shapes in bf16: every row of a 64-row and a
  128-row product equals the row computed alone (cuBLAS, the control, is allowed to differ);
- a Llama-3.2-1B-shaped random bf16 model through the whole engine (Triton attention, CUDA
  graphs, async scheduling): a prompt alone and inside a batch of 64 other requests gives
  the same tokens and bit-identical logits at every step.

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_deterministic_gpu.py``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.deterministic_support import TARGET_OUT, run_target, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)])
def test_bi_linear_rows_match_alone(n: int, k: int) -> None:
    from engine.models.triton_batch_invariant import bi_linear

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(128, k, generator=gen, device="cuda").to(torch.bfloat16)
    alone = torch.cat([bi_linear(x[i : i + 1], w, None) for i in (0, 5, 63, 127)])
    for m in (64, 128):
        batch = bi_linear(x[:m], w, None)
        rows = [i for i in (0, 5, 63, 127) if i < m]
        assert torch.equal(batch[rows], alone[: len(rows)]), f"M={m}: a row changed"
    ref = x.float() @ w.float().T
    err = float((bi_linear(x, w, None).float() - ref).norm() / ref.norm())
    assert err < 1e-2


def _save_random_llama(out: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    params = json.loads((CONFIGS / "llama-3.2-1b" / "config.json").read_text())
    for key in ("architectures", "model_type", "torch_dtype"):
        params.pop(key, None)
    params["num_hidden_layers"] = 4  # the shape of a real layer; four are enough here
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**params)).to(torch.bfloat16).eval()
    model.save_pretrained(str(out))
    return out


def test_prompt_alone_and_in_a_batch_of_64_are_bit_identical(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    model_dir = _save_random_llama(tmp_path / "l1b", seed=5)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
            deterministic=True, max_num_seqs=128, enable_prefix_caching=False,
        )
    )  # fmt: skip
    target, others = workload(64, 41)
    alone_tokens, alone_logits = run_target(engine, [], target, "alone")
    batch_tokens, batch_logits = run_target(engine, others, target, "batch")
    engine.shutdown()
    assert len(alone_tokens) == TARGET_OUT and batch_tokens == alone_tokens
    for step, (a, b) in enumerate(zip(alone_logits, batch_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3e}"
