"""The Triton FP8 GEMV (engine/models/triton_fp8_gemv.py) against float64, on the CPU
through Triton's interpreter (in a child process, as tests/triton_interpreter.py
explains); its refusals. ``run_cases`` is shared with tests/gpu/test_fp8_gpu.py.

Bound per output element, against the float64 ``ref = (x @ Wq.T) * scale + b`` of the same
e4m3 weights and the same (rounded) ``x``, with ``mag = (|x| @ |Wq|.T) * scale + |b|``:
``|y - ref| <= r * |ref| + 2^-19 * mag``: ``r`` the cast to the output dtype (0 for
float32; a bf16/fp16 ulp under the interpreter, which truncates, half of one on the GPU),
the second term float32 summation order (test_triton_gemv.py states the same bound).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

Config = tuple[int, int, int, int] | None
# name: (M, N, K, x dtype, bias, x row padding, config or None for the default)
CASES: dict[str, tuple[int, int, int, str, bool, int, Config]] = {
    "m1_f32_ragged": (1, 40, 96, "float32", False, 0, (16, 64, 4, 1)),
    "m3_f32_bias_strided": (3, 33, 130, "float32", True, 7, (8, 32, 2, 2)),
    "m4_f32_even": (4, 64, 256, "float32", False, 0, (16, 128, 4, 2)),
    "m1_bf16_even": (1, 64, 256, "bfloat16", False, 0, (8, 64, 2, 1)),
    "m2_bf16_default_config": (2, 96, 320, "bfloat16", True, 0, None),
    "m4_bf16_bias_strided": (4, 50, 200, "bfloat16", True, 5, (16, 64, 4, 3)),
    "m3_f16_default_config": (3, 24, 512, "float16", False, 16, None),
}
ULP = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}
SUM_TOL = 2.0**-19


def fp8_gemv_error(
    m: int, n: int, k: int, dtype_name: str, bias: bool, pad: int, config: Config,
    device: str, seed: int, ulp_scale: float, sum_tol: float = SUM_TOL,
) -> float:  # fmt: skip
    """Largest ``|y - ref| / bound`` (<= 1 passes; inf for a wrong dtype or shape)."""
    import torch

    from engine.models.fp8 import quantize_rows
    from engine.models.triton_fp8_gemv import fp8_gemv

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    x = torch.randn((m, k + pad), generator=gen, device=device).to(dtype)[:, :k]
    # Rows of different magnitudes, so the per-channel scales differ.
    w = torch.randn((n, k), generator=gen, device=device)
    w = w * torch.logspace(-2, 1, n, device=device)[:, None]
    wq, scale = quantize_rows(w)
    b = torch.randn((n,), generator=gen, device=device).to(dtype) if bias else None
    y = fp8_gemv(x, wq, scale, b, config)
    if y.dtype != dtype or y.shape != (m, n):
        return float("inf")
    return fp8_bound_ratio(y, x, wq, scale, b, ULP[dtype_name] * ulp_scale, sum_tol)


def fp8_bound_ratio(
    y: Any, x: Any, wq: Any, scale: Any, b: Any, rel: float, sum_tol: float
) -> float:
    x64, w64, s64 = x.double(), wq.double(), scale.double()
    ref = (x64 @ w64.T) * s64
    mag = (x64.abs() @ w64.abs().T) * s64
    if b is not None:
        ref += b.double()
        mag += b.double().abs()
    bound = rel * ref.abs() + sum_tol * mag
    return float(((y.double() - ref).abs() / bound).max())


def run_cases(device: str, ulp_scale: float) -> dict[str, float]:
    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    return {
        name: fp8_gemv_error(*spec, device, seed + i, ulp_scale)
        for i, (name, spec) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_gemv_matches_reference(interpreted: dict[str, float], name: str) -> None:
    assert interpreted[name] <= 1.0, f"{name}: error is {interpreted[name]:.3g}x the bound"


def _bad_inputs() -> dict[str, tuple[tuple[Any, Any, Any, Any], str]]:
    import torch

    fp8 = torch.float8_e4m3fn
    x, w, s = torch.randn(2, 64), torch.randn(24, 64).to(fp8), torch.ones(24)
    return {
        "five_rows": ((torch.randn(5, 64), w, s, None), "x \\[1..4, K\\]"),
        "k_mismatch": ((torch.randn(2, 63), w, s, None), "do not match"),
        "bf16_weight": ((x, w.to(torch.bfloat16), s, None), "float8_e4m3fn"),
        "float64_x": ((x.double(), w, s, None), "float8_e4m3fn"),
        "scale_shape": ((x, w, torch.ones(24, 1), None), "scale must be"),
        "scale_bf16": ((x, w, s.bfloat16(), None), "scale must be"),
        "x_strided_k": ((torch.randn(2, 128)[:, ::2], w, s, None), "contiguous"),
        "bias_shape": ((x, w, s, torch.randn(23)), "bias must be"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_fp8_gemv_refuses(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    from engine.models.triton_fp8_gemv import fp8_gemv

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # pass the device check; inputs are tested
    args, match = _bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        fp8_gemv(*args)


def test_fp8_gemv_refuses_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from engine.models.triton_fp8_gemv import fp8_gemv

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.randn(8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="CUDA"):
        fp8_gemv(torch.randn(1, 16), w, torch.ones(8))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run_cases("cpu", ulp_scale=1.0)))
