"""The fused RoPE + paged-KV-store kernel on the GPU at model head shapes (the CPU
interpreter runs the same checks small: tests/unit/test_triton_rope_store_kv.py).

The fused kernel must match the unfused Triton path (RoPE kernel + the backend's KV write)
bit for bit; against ``TorchOps`` it is held to one ulp of the dtype, because the GPU
compiler folds one rounded product into an FMA (see the unit module's docstring).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.test_triton_rope_store_kv import (
    GPU_TORCH_TOL,
    MODEL_CASES,
    SMALL_CASES,
    run_cases,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# Llama-3.1-8B's heads (32 q over 8 KV, head_dim 128) and a 1B's (head_dim 64), at a
# prefill-sized and a decode-sized batch, plus every small case.
CASES: dict[str, tuple[int, tuple[int, int, int], str, int]] = {
    **SMALL_CASES,
    "8b_prefill_bf16": (513, (32, 8, 128), "bfloat16", 16),
    "8b_decode_bf16": (64, (32, 8, 128), "bfloat16", 16),
    "8b_f32": (33, (32, 8, 128), "float32", 16),
    "8b_f16": (40, (32, 8, 128), "float16", 32),
    "1b_bf16": (64, (32, 8, 64), "bfloat16", 16),
}
GPU_MODEL_CASES: dict[str, tuple[list[int], list[int], str]] = {
    **MODEL_CASES,
    "model_mixed_bf16": ([9, 1, 1], [0, 17, 40], "bfloat16"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_cases(CASES, GPU_MODEL_CASES, "cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_rope_store_kv_kernel_on_gpu(results: dict[str, dict[str, Any]], name: str) -> None:
    r = results[name]
    assert r["q_contiguous"]
    assert r["unfused_equal"], "q or cache differs from the rope + write_kv_cache kernels"
    assert r["untouched"], "a slot outside the valid slot_mapping entries changed"
    assert r["stored_v"], "v was not stored unchanged at its slot"
    assert r["fallback_equal"], "the non-contiguous-cache fallback differs"
    tol = GPU_TORCH_TOL[CASES[name][2]]
    assert r["torch_rel"] <= tol, f"vs TorchOps: {r['torch_rel']:.3e} > {tol}"


@pytest.mark.parametrize("name", list(GPU_MODEL_CASES))
def test_tiny_model_fused_equals_unfused_on_gpu(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    r = results[name]
    assert r["fused_calls"] == ["prewritten"] * 2
    assert r["unfused_calls"] == ["forward"] * 2
    assert r["cache_equal"], "the fused path left a different KV cache"
    assert r["logits_equal"], "fused-path logits differ from the unfused path"
    if "torch_rel" in r:
        assert r["torch_rel"] < 1e-5, f"vs torch_ref + TorchOps: {r['torch_rel']:.3e}"
