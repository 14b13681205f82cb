"""The split-K FP8 GEMM (engine/models/triton_fp8_gemm.py) on the GPU against cuBLASLt's
row-wise ``torch._scaled_mm`` at Llama-3.1-8B's projection shapes and decode row counts,
through several tile configs, split counts included (the interpreter runs small shapes on
the CPU: tests/unit/test_fp8_gemm_interpret.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}
CONFIGS = [(16, 64, 128, 1), (16, 64, 128, 4), (32, 128, 256, 8), (64, 64, 128, 16)]


@pytest.mark.parametrize("rows", [5, 16, 64, 200])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tiles", CONFIGS, ids=lambda t: "m{}n{}k{}s{}".format(*t))
def test_split_k_matches_cublas(rows: int, shape: str, tiles: tuple[int, int, int, int]) -> None:
    from engine.models.fp8 import quantize_rows
    from engine.models.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm

    n, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    weight, w_scale = quantize_rows(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    xq, x_scale = quantize_rows(torch.randn(rows, k, device="cuda", generator=gen))
    ref = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
        out_dtype=torch.bfloat16,
    ).float()  # fmt: skip
    out = fp8_gemm(xq, x_scale, weight, w_scale, Fp8GemmConfig(*tiles)).float()
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 1e-2, f"max error {err:.3e} of the largest output"
