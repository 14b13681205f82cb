"""The split-K FP8 GEMM (engine/models/triton_fp8_gemm.py) on the CPU through Triton's
interpreter (a child process: tests/triton_interpreter.py) against the float32 reference
of W8A8 (engine/models/fp8.py ``_reference_mm``): row counts that do and do not fill the
M tile, one and several K slices (the atomic path), a bias added once, and tiles that
overhang N. The table lookup and the config checks run in-process."""

from __future__ import annotations

import json

import pytest

from tests.triton_interpreter import run_interpreted

# id: (rows, n, k, block_m, block_n, block_k, split_k, bias)
CASES: dict[str, tuple[int, int, int, int, int, int, int, bool]] = {
    "m1_split1": (1, 48, 64, 16, 16, 32, 1, False),
    "m5_split2_bias": (5, 40, 128, 16, 32, 32, 2, True),
    "m16_split4": (16, 64, 256, 16, 16, 64, 4, False),
    "m37_split2_overhang_n": (37, 72, 128, 32, 64, 64, 2, True),
    "m64_split1_bias": (64, 32, 64, 16, 32, 64, 1, True),
}
SEEDS = (3, 17)


def _run_case(spec: tuple, seed: int) -> float:  # type: ignore[type-arg]
    import torch

    from engine.models.fp8 import _reference_mm, quantize_rows
    from engine.models.triton_fp8_gemm import Fp8GemmConfig, fp8_gemm

    m, n, k, bm, bn, bk, split, with_bias = spec
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    weight, w_scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen) if with_bias else None
    xq, x_scale = quantize_rows(x)
    config = Fp8GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_stages=1)
    out = fp8_gemm(xq, x_scale, weight, w_scale, config, bias, out_dtype=torch.float32)
    ref = _reference_mm(x, weight, w_scale) + (bias if bias is not None else 0.0)
    return float((out - ref).abs().max() / ref.abs().max())


def main() -> None:
    import torch

    torch.set_num_threads(1)
    results = {
        f"{name}_seed{seed}": _run_case(spec, seed)
        for name, spec in CASES.items()
        for seed in SEEDS
    }
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    payload, _ = run_interpreted(__file__)
    results: dict[str, float] = payload
    return results


@pytest.mark.parametrize("name", [f"{c}_seed{s}" for c in CASES for s in SEEDS])
def test_split_k_matches_reference(interpreted: dict[str, float], name: str) -> None:
    err = interpreted[name]
    assert err < 1e-5, f"{name}: max error {err:.3e} of the largest output"


def test_config_checks_and_table_lookup(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from engine.models import triton_fp8_gemm as mod

    with pytest.raises(ValueError, match="power of two"):
        mod.Fp8GemmConfig(block_n=24).check(256)
    with pytest.raises(ValueError, match="whole 128-wide tiles"):
        mod.Fp8GemmConfig(split_k=3).check(1024)
    table = tmp_path / "fp8_gemm_configs.json"
    winner = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 8,
              "num_warps": 4, "num_stages": 3}  # fmt: skip
    table.write_text(
        json.dumps({"shapes": {"6144,4096": [[16, winner], [64, None], [128, winner]]}})
    )
    monkeypatch.setattr(mod, "CONFIG_FILE", table)
    mod._tuned.cache_clear()
    try:
        assert mod.tuned_config(5, 6144, 4096) == mod.Fp8GemmConfig(**winner)
        assert mod.tuned_config(48, 6144, 4096) is None  # cuBLAS won at 64 rows
        assert mod.tuned_config(100, 6144, 4096) == mod.Fp8GemmConfig(**winner)
        assert mod.tuned_config(300, 6144, 4096) is None  # beyond the table
        assert mod.tuned_config(5, 4096, 4096) is None  # shape never tuned
        # One table per GPU kind; a kind without one takes the first.
        other = {"block_m": 32, "block_n": 64, "block_k": 128, "split_k": 4,
                 "num_warps": 4, "num_stages": 3}  # fmt: skip
        table.write_text(
            json.dumps(
                {
                    "gpus": {
                        "NVIDIA H200": {"shapes": {"6144,4096": [[16, winner]]}},
                        "NVIDIA H100 80GB HBM3": {"shapes": {"6144,4096": [[16, other]]}},
                    }
                }
            )
        )
        mod._tuned.cache_clear()
        assert mod._tuned("NVIDIA H100 80GB HBM3")[(6144, 4096)][0][1] == mod.Fp8GemmConfig(**other)
        assert mod._tuned("NVIDIA H200")[(6144, 4096)][0][1] == mod.Fp8GemmConfig(**winner)
        assert mod._tuned("NVIDIA A100")[(6144, 4096)][0][1] == mod.Fp8GemmConfig(**winner)
    finally:
        mod._tuned.cache_clear()


if __name__ == "__main__":
    main()
