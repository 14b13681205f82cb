"""The fused element-wise Triton kernels against torch on the GPU, at model sizes (the
CPU interpreter runs the same cases small: tests/unit/test_triton_layer_ops.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.test_triton_layer_ops import GPU_TOL, SMALL_CASES, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32 q heads over 8 KV heads of 128), a
# 1B's (head dim 64) and an odd hidden size, plus every small case.
CASES: dict[str, tuple[str, int, Any, str]] = {
    **SMALL_CASES,
    "rms_norm_8b_bf16": ("rms_norm", 300, 4096, "bfloat16"),
    "add_rms_norm_8b_bf16": ("add_rms_norm", 257, 4096, "bfloat16"),
    "add_rms_norm_odd_bf16": ("add_rms_norm", 3, 3000, "bfloat16"),
    "silu_mul_8b_bf16": ("silu_mul", 129, 14336, "bfloat16"),
    "rope_8b_bf16": ("rope", 513, (32, 8, 128), "bfloat16"),
    "rope_1b_bf16": ("rope", 64, (32, 8, 64), "bfloat16"),
    "rope_8b_f32": ("rope", 33, (32, 8, 128), "float32"),
    "model_tiny_bf16": ("model", 37, None, "bfloat16"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return run_cases(CASES, "cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_fused_op_matches_torch_on_gpu(results: dict[str, float], name: str) -> None:
    tol = GPU_TOL[CASES[name][3]] * (4 if CASES[name][0] == "model" else 1)
    assert results[name] < tol, f"{name}: relative difference {results[name]:.3e} >= {tol}"
