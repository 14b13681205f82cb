"""The Triton GEMV (engine/models/triton_gemv.py) against an exact reference, on the CPU
through Triton's interpreter; its validation, ``supports_gemv`` and the ``linear`` op.

As in test_triton_layer_ops.py, the interpreter must be on before triton is imported, so
the kernel cases run in one child process (this file as a script) that prints JSON; each
case is its own test here. ``run_cases`` is shared with tests/gpu/test_gemv_gpu.py, which
runs the same cases and Llama-3.1-8B's projection shapes on the GPU.

Tolerance, per output element, against the float64 result ``ref`` of the same (rounded)
inputs, with ``mag = |x| @ |W|.T + |b|``: ``|y - ref| <= r * |ref| + 2^-19 * mag``. The
second term bounds float32 summation order at these K (errors of ~2^-24 * mag are typical;
the GPU test's K up to 14336 allows 2^-16). ``r`` is the cast to the output dtype: 0 for
float32; for bf16/fp16 one unit in the last place (2^-7, 2^-10) under the interpreter,
whose bf16 casts truncate instead of rounding (test_triton_layer_ops notes it), and half
of one (2^-8, 2^-11) on the GPU, which rounds to nearest.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

Config = tuple[int, int, int, int] | None
# name: (M, N, K, dtype, bias, x row padding (strided rows when > 0), config or None for
# the default). Ragged N and K (not multiples of the blocks) take the masked paths.
SMALL_CASES: dict[str, tuple[int, int, int, str, bool, int, Config]] = {
    "m1_f32_ragged": (1, 40, 96, "float32", False, 0, (16, 64, 4, 1)),
    "m3_f32_bias_strided": (3, 33, 130, "float32", True, 7, (8, 32, 2, 2)),
    "m2_f32_odd_k": (2, 19, 77, "float32", False, 3, (4, 32, 1, 1)),
    "m4_f32_even_bias": (4, 64, 256, "float32", True, 0, (16, 128, 4, 2)),
    "m1_bf16_even": (1, 64, 256, "bfloat16", False, 0, (8, 64, 2, 1)),
    "m4_bf16_bias_strided": (4, 50, 200, "bfloat16", True, 5, (16, 64, 4, 3)),
    "m2_bf16_default_config": (2, 96, 320, "bfloat16", False, 0, None),
    "m3_f16_bias_strided": (3, 24, 512, "float16", True, 16, (8, 256, 4, 2)),
    "m1_bf16_block_wider_than_k": (1, 10, 48, "bfloat16", True, 0, (32, 128, 4, 1)),
    "m4_f32_default_config": (4, 72, 160, "float32", False, 9, None),
}
ULP = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}
SUM_TOL = 2.0**-19


def gemv_error(
    m: int,
    n: int,
    k: int,
    dtype_name: str,
    bias: bool,
    pad: int,
    config: Config,
    device: str,
    seed: int,
    ulp_scale: float,
    sum_tol: float = SUM_TOL,
) -> float:
    """Largest ``|y - ref| / bound`` over the output (<= 1 passes; inf: wrong dtype/shape)."""
    import torch

    from engine.models.triton_gemv import gemv

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, dtype_name)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    x = rand(m, k + pad)[:, :k]  # pad > 0: rows k + pad apart
    w = rand(n, k)
    b = rand(n) if bias else None
    y = gemv(x, w, b, config)
    if y.dtype != dtype or y.shape != (m, n):
        return float("inf")
    return bound_ratio(y, x, w, b, ULP[dtype_name] * ulp_scale, sum_tol)


def bound_ratio(y: Any, x: Any, w: Any, b: Any, rel: float, sum_tol: float = SUM_TOL) -> float:
    """max ``|y - ref| / (rel * |ref| + sum_tol * mag)``, ref and mag in float64."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    mag = x64.abs() @ w64.abs().T
    if b is not None:
        ref += b.double()
        mag += b.double().abs()
    bound = rel * ref.abs() + sum_tol * mag
    return float(((y.double() - ref).abs() / bound).max())


def routing_error(device: str, seed: int) -> float:
    """``TritonOps.linear`` is the GEMV at <= 4 rows and ``F.linear`` beyond; ``TorchOps``
    is ``F.linear``. 0.0 when every result is the expected one bit for bit."""
    import torch
    import torch.nn.functional as F

    from engine.models.layer_ops import TorchOps
    from engine.models.triton_gemv import gemv
    from engine.models.triton_ops import TritonOps

    torch.manual_seed(seed)
    w, b = torch.randn(24, 64, device=device), torch.randn(24, device=device)
    small, big = torch.randn(2, 64, device=device), torch.randn(5, 64, device=device)
    same = (
        torch.equal(TritonOps.linear(small, w, b), gemv(small, w, b))
        and torch.equal(TritonOps.linear(big, w, b), F.linear(big, w, b))
        and torch.equal(TorchOps.linear(small, w, b), F.linear(small, w, b))
    )
    return 0.0 if same else float("inf")


def run_cases(
    cases: dict[str, tuple[int, int, int, str, bool, int, Config]],
    device: str,
    ulp_scale: float,
    model_tokens: int = 3,
) -> dict[str, float]:
    """Every GEMV case, the ``linear`` routing, and a tiny Llama at ``model_tokens`` rows
    (so its projections take the GEMV) under TritonOps vs TorchOps."""
    from tests.unit.test_triton_layer_ops import _model_case

    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    out = {
        name: gemv_error(*spec, device, seed + i, ulp_scale)
        for i, (name, spec) in enumerate(cases.items())
    }
    out["routing"] = routing_error(device, seed)
    import torch

    for dtype in ("float32", "bfloat16"):
        out[f"model_{dtype}"] = _model_case(model_tokens, getattr(torch, dtype), device, seed)
    return out


# The tiny model (2 layers) vs TorchOps, largest difference over the largest output: the
# bounds test_triton_layer_ops.py uses for its model case.
MODEL_TOL = {"model_float32": 2e-6, "model_bfloat16": 2**-5}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_gemv_matches_reference(interpreted: dict[str, float], name: str) -> None:
    assert interpreted[name] <= 1.0, f"{name}: error is {interpreted[name]:.3g}x the bound"


def test_linear_op_routes_small_batches_to_gemv(interpreted: dict[str, float]) -> None:
    assert interpreted["routing"] == 0.0


@pytest.mark.parametrize("name", list(MODEL_TOL))
def test_model_with_gemv_matches_torch(interpreted: dict[str, float], name: str) -> None:
    tol = MODEL_TOL[name]
    assert interpreted[name] < tol, f"{name}: relative difference {interpreted[name]:.3e}"


# ---------------------------------------------------------------- checks (no kernel runs)


def _tensors(**kw: Any) -> tuple[Any, Any, Any]:
    """Valid x [2, 64], weight [24, 64], bias [24] (float32), with ``kw`` replacing any."""
    import torch

    t = {"x": torch.randn(2, 64), "w": torch.randn(24, 64), "b": torch.randn(24)}
    t.update(kw)
    return t["x"], t["w"], t["b"]


def _bad_inputs() -> dict[str, tuple[tuple[Any, Any, Any], str]]:
    import torch

    return {
        "x_1d": (_tensors(x=torch.randn(64)), r"x \[M, K\]"),
        "no_rows": (_tensors(x=torch.randn(0, 64)), "1 to 4 rows"),
        "five_rows": (_tensors(x=torch.randn(5, 64)), "1 to 4 rows"),
        "k_mismatch": (_tensors(x=torch.randn(2, 63)), "do not match"),
        "float64": (_tensors(x=torch.randn(2, 64).double(), w=torch.randn(24, 64).double()), "dtypes"),
        "int": (_tensors(x=torch.ones(2, 64, dtype=torch.int32)), "dtypes"),
        "mixed_dtypes": (_tensors(x=torch.randn(2, 64).bfloat16()), "dtypes"),
        "x_strided_along_k": (_tensors(x=torch.randn(2, 128)[:, ::2]), "contiguous along K"),
        "weight_transposed": (_tensors(w=torch.randn(64, 24).T), "weight must be contiguous"),
        "bias_shape": (_tensors(b=torch.randn(23)), "bias must be"),
        "bias_dtype": (_tensors(b=torch.randn(24).half()), "bias must be"),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_unsupported_inputs_are_refused(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    from engine.models.triton_gemv import gemv, supports_gemv

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # pass the device check; inputs are tested
    (x, w, b), match = _bad_inputs()[case]
    assert not supports_gemv(x, w, b)
    with pytest.raises(ValueError, match=match):
        gemv(x, w, b)


@pytest.mark.parametrize(
    "config", [(12, 64, 4, 1), (16, 8, 4, 1), (16, 64, 3, 1), (16, 64, 4, 0), (16, 64, 4)]
)
def test_bad_configs_are_refused(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    from engine.models.triton_gemv import gemv

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="BLOCK|num_|config"):
        gemv(*_tensors(), config=config)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models.triton_gemv import gemv, supports_gemv

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, b = _tensors()
    assert not supports_gemv(x, w, b)
    with pytest.raises(ValueError, match="CUDA"):
        gemv(x, w, b)


def test_supported_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from engine.models.triton_gemv import supports_gemv

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w, b = _tensors()
    assert supports_gemv(x, w) and supports_gemv(x, w, b)
    assert supports_gemv(torch.randn(4, 80)[:, :64], w)  # strided rows
    for dtype in (torch.bfloat16, torch.float16):
        assert supports_gemv(x.to(dtype), w.to(dtype), b.to(dtype))


def test_torch_ops_linear_without_gemv_is_f_linear() -> None:
    """Off the GEMV (CPU without the interpreter, or > 4 rows) TritonOps.linear is F.linear,
    and TorchOps.linear always is: the CPU engine's results do not move."""
    import torch
    import torch.nn.functional as F

    from engine.models.layer_ops import TorchOps
    from engine.models.triton_ops import TritonOps

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("run this test without TRITON_INTERPRET=1: it checks the fallback")
    layer = torch.nn.Linear(64, 24)
    for x in (torch.randn(2, 64), torch.randn(7, 64)):
        for ops in (TorchOps, TritonOps):
            assert torch.equal(ops.linear(x, layer.weight, layer.bias), layer(x))
            assert torch.equal(ops.linear(x, layer.weight, None), F.linear(x, layer.weight))


def test_default_configs_fit_the_8b_shapes() -> None:
    """Powers of two, a grid of >= 2 programs per SM where N allows, BLOCK_K within
    [128, 1024], and float32 accumulators of <= 128 values per thread at 4 rows."""
    import torch

    from engine.models.triton_gemv import gemv_config

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for m in (1, 2, 4):
            bn, bk, warps, stages = gemv_config(n, k, torch.bfloat16, m)
            for v in (bn, bk, warps):
                assert v & (v - 1) == 0, (n, k, m, bn, bk, warps)
            assert -(-n // bn) >= 2 * 132, (n, k, m, bn)
            assert 128 <= bk <= 1024 and stages >= 1
            assert bn * bk * m <= 128 * 32 * warps, (n, k, m, bn, bk, warps)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run_cases(SMALL_CASES, "cpu", ulp_scale=1.0)))
