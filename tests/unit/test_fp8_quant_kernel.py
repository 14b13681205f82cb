"""The one-launch per-row e4m3 quantization (engine/models/triton_fp8_quant.py) against
``fp8.quantize_rows`` (the torch form it replaces on CUDA), on the CPU through Triton's
interpreter in a child process (tests/triton_interpreter.py says why). Seeds are fixed.

The scales must agree to float32 rounding (both divide the same amax by 448). The e4m3
values may differ by one e4m3 step (the interpreter truncates where the GPU and torch round
to nearest even); a difference of more than one step, or a sign flip, fails. ``run_cases`` is shared with tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.triton_interpreter import interpreted_results

# name: (rows, K, dtype, row padding)
CASES: dict[str, tuple[int, int, str, int]] = {
    "one_row_bf16": (1, 4096, "bfloat16", 0),
    "ragged_k_f32": (5, 1000, "float32", 0),
    "strided_rows_bf16": (7, 2112, "bfloat16", 64),
    "zero_row_f16": (3, 256, "float16", 0),
}
SEEDS = (11, 12, 13)


def quant_mismatch(
    rows: int, k: int, dtype_name: str, pad: int, device: str, seed: int
) -> dict[str, float]:
    import torch

    from engine.models.fp8 import _MIN_SCALE, FP8_MAX, quantize_rows
    from engine.models.triton_fp8_quant import quantize_rows_triton
    from tests.fp8_support import e4m3_mismatch

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((rows, k + pad), generator=gen, device=device)
    x = (x * torch.logspace(-3, 2, rows, device=device)[:, None]).to(getattr(torch, dtype_name))
    x = x[:, :k]
    if dtype_name == "float16":
        x[1].zero_()  # an all-zero row takes the scale floor
    q, s = quantize_rows_triton(x, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_rows(x)
    return e4m3_mismatch(q, s, q_ref, s_ref)


def run_cases(device: str) -> dict[str, Any]:
    print(f"seeds {SEEDS}", file=sys.stderr)
    return {
        f"{name}/{seed}": quant_mismatch(*spec, device, seed)
        for name, spec in CASES.items()
        for seed in SEEDS
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_quant_kernel_matches_torch(interpreted: dict[str, Any], name: str) -> None:
    for seed in SEEDS:
        r = interpreted[f"{name}/{seed}"]
        assert r["dtype_ok"] == 1.0
        assert r["scale_rel_err"] <= 2.0**-22, r
        assert r["max_steps"] <= 1.0, r
        # The interpreter truncates float -> e4m3 (the GPU rounds to nearest even, as
        # torch does), so a few percent differ by one step here; none by more.
        assert r["mismatch_fraction"] <= 0.06, r


def test_quant_kernel_refuses_non_contiguous_rows() -> None:
    import torch

    from tests.triton_interpreter import run_interpreted  # noqa: F401  (triton must exist)

    x = torch.zeros((4, 8)).t()
    with pytest.raises(ValueError, match="contiguous rows"):
        from engine.models.triton_fp8_quant import quantize_rows_triton

        quantize_rows_triton(x, 448.0, 1e-6)


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)
