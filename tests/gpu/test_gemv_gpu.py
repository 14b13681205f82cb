"""The Triton GEMV on the GPU: the interpreter's cases (tests/unit/test_triton_gemv.py) and
Llama-3.1-8B's projections at 1-4 rows, in bf16, against float64 and against F.linear.

Bounds (stated in test_triton_gemv.py): per element ``|y - ref| <= 2^-8 |ref| + s * mag``
against the float64 result, half a bf16 ulp for the rounding plus float32 summation order
(``s`` = 2^-16 at K up to 14336). Against cuBLAS (``F.linear``, which by torch's default
may reduce split-K partials in bf16) the largest difference over the largest output is at
most 2^-7, the layer-ops tests' bf16 convention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_triton_gemv import SMALL_CASES, bound_ratio, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

# name: (M, N, K, bias) at Llama-3.1-8B's widths; qkv with a bias stands in for Qwen2.
SHAPES_8B: dict[str, tuple[int, int, int, bool]] = {
    "qkv_m1": (1, 6144, 4096, False),
    "qkv_m2": (2, 6144, 4096, False),
    "qkv_m4_bias": (4, 6144, 4096, True),
    "o_m1": (1, 4096, 4096, False),
    "o_m3": (3, 4096, 4096, False),
    "gate_up_m1": (1, 28672, 4096, False),
    "down_m1": (1, 4096, 14336, False),
    "down_m4": (4, 4096, 14336, False),
    "lm_head_m1": (1, 128256, 4096, False),
}
MODEL_TOL = {"model_float32": 8e-6, "model_bfloat16": 2**-5}


@pytest.fixture(scope="module")
def small_results() -> dict[str, float]:
    return run_cases(SMALL_CASES, "cuda", ulp_scale=0.5)


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_small_cases_on_gpu(small_results: dict[str, float], name: str) -> None:
    assert small_results[name] <= 1.0, f"{name}: error is {small_results[name]:.3g}x the bound"


def test_linear_op_routing_on_gpu(small_results: dict[str, float]) -> None:
    assert small_results["routing"] == 0.0


@pytest.mark.parametrize("name", list(MODEL_TOL))
def test_model_with_gemv_on_gpu(small_results: dict[str, float], name: str) -> None:
    assert small_results[name] < MODEL_TOL[name], f"{name}: {small_results[name]:.3e}"


@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_8b_projection_matches_float64_and_cublas(name: str) -> None:
    from engine.models.triton_gemv import gemv, supports_gemv

    m, n, k, has_bias = SHAPES_8B[name]
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
    b = torch.randn(n, generator=gen, device="cuda").bfloat16() if has_bias else None
    assert supports_gemv(x, w, b)
    y = gemv(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ratio = bound_ratio(y, x, w, b, rel=2.0**-8, sum_tol=2.0**-16)
    assert ratio <= 1.0, f"{name}: error vs float64 is {ratio:.3g}x the bound"
    want = F.linear(x, w, b).float()
    vs_cublas = float((y.float() - want).abs().max() / want.abs().max())
    assert vs_cublas <= 2.0**-7, f"{name}: vs F.linear {vs_cublas:.3e}"


def test_gemv_replays_in_a_cuda_graph() -> None:
    """Decode steps run captured: the launch must be capturable and read x at replay."""
    from engine.models.triton_gemv import gemv

    x = torch.randn(2, 4096, device="cuda").bfloat16()
    w = torch.randn(6144, 4096, device="cuda").bfloat16()
    gemv(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, gemv(x, w))
