"""The fused FP8 activation kernels (engine/models/triton_fp8_fused.py) give the bytes of
the unfused path: the Triton layer op (RMSNorm with the residual add, or SiLU·mul) writing
the row in the model dtype, then ``fp8.quantize_rows`` (on the interpreter, whose division
is IEEE; the GPU test demands the bytes of the Triton quantizer and bounds torch's). On the CPU through Triton's
interpreter in a child process (tests/triton_interpreter.py says why); ``run_cases`` is
shared with tests/gpu/test_fp8_fused_gpu.py, which also checks the one-launch quantizer
the GPU path uses. Seeds are fixed."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.triton_interpreter import interpreted_results

# name: (op, rows, columns, dtype); columns of SiLU·mul are the output's (gate_up / 2)
CASES: dict[str, tuple[str, int, int, str]] = {
    "norm_residual_bf16": ("add_norm", 7, 4096, "bfloat16"),
    "norm_first_layer_bf16": ("norm", 5, 4096, "bfloat16"),
    "norm_ragged_f16": ("add_norm", 6, 1000, "float16"),
    "norm_residual_f32": ("add_norm", 5, 512, "float32"),
    "silu_llama8b_bf16": ("silu", 5, 14336, "bfloat16"),
    "silu_ragged_f32": ("silu", 6, 3000, "float32"),
}
SEEDS = (21, 22)


def fused_mismatch(op: str, rows: int, cols: int, dtype_name: str, device: str, seed: int):
    import torch

    from engine.models.fp8 import quantize_rows
    from engine.models.triton_fp8_fused import rms_norm_fp8, silu_mul_fp8
    from engine.models.triton_ops import TritonOps

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        mag = torch.logspace(-2, 1, shape[0], device=device)[:, None]
        return (torch.randn(shape, generator=gen, device=device) * mag).to(dtype)

    out: dict[str, Any] = {}
    if op == "silu":
        gate_up = randn(rows, 2 * cols) * 3
        gate_up[1].zero_()  # an all-zero row takes the scale floor
        act = fused = silu_mul_fp8(gate_up)
        ref = TritonOps.silu_mul(gate_up)
    else:
        x, weight = randn(rows, cols), 1.0 + 0.1 * randn(1, cols)[0]
        res = randn(rows, cols) if op == "add_norm" else None
        res_ref = None if res is None else res.clone()
        act = fused = rms_norm_fp8(x, res, weight, 1e-5)
        if res_ref is None:
            ref = TritonOps.rms_norm(x, weight, 1e-5)
        else:
            ref, res_ref = TritonOps.add_rms_norm(x, res_ref, weight, 1e-5)
            out["residual_equal"] = bool(torch.equal(res, res_ref))
    q_ref, s_ref = quantize_rows(ref)
    out["q_mismatch"] = float((act.q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
    out["scale_equal"] = bool(torch.equal(fused.scale, s_ref))
    # Triton's float32 division on the GPU is div.full (within 2 ulp), torch's is IEEE: the
    # GPU test bounds the difference to torch and demands equality with the Triton quantizer.
    out["scale_rel_err"] = float(((fused.scale - s_ref).abs() / s_ref).max())
    diff = (act.q.float() - q_ref.float()).abs()
    allowed = torch.maximum(q_ref.float().abs() * 2.0**-3, torch.full_like(diff, 2.0**-9))
    out["max_steps"] = float((diff / allowed).max())
    out["q_mismatch_fraction"] = out["q_mismatch"] / act.q.numel()
    out["dtypes_ok"] = fused.q.dtype == torch.float8_e4m3fn and fused.dtype == dtype
    if device == "cuda":  # the quantizer the unfused GPU path runs
        from engine.models.fp8 import _MIN_SCALE, FP8_MAX
        from engine.models.triton_fp8_quant import quantize_rows_triton

        q_t, s_t = quantize_rows_triton(ref, FP8_MAX, _MIN_SCALE)
        out["q_mismatch_vs_triton_quant"] = float(
            (act.q.view(torch.uint8) != q_t.view(torch.uint8)).sum()
        )
        out["scale_equal_vs_triton_quant"] = bool(torch.equal(fused.scale, s_t))
    return out


def model_case(seed: int) -> dict[str, Any]:
    """A tiny FP8 model (weights and KV) with the Triton layer ops on the CPU: logits with
    the fusions on equal those with them off. The device check of ``fusable_input`` is
    lifted for this run only (on the CPU the model never fuses by itself)."""
    import torch

    import engine.models
    import engine.models.llama as llama
    from engine.attention.kv_quant import FP8_DTYPE
    from engine.attention.triton_backend import TritonAttention
    from engine.executor.step_testing import SyntheticRequests
    from engine.models import ModelArgs
    from engine.models.fp8 import fusable_shapes
    from engine.models.fp8_loader import Fp8Scheme
    from engine.models.triton_ops import TritonOps

    engine.models.get_layer_ops = lambda *a, **k: TritonOps  # type: ignore[assignment]
    calls = {"fused": 0}

    def anywhere(proj: object, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        ok = fusable_shapes(proj, x, residual)
        calls["fused"] += ok
        return ok

    llama.fusable_input = anywhere  # type: ignore[assignment]
    args = ModelArgs(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
        intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
    )  # fmt: skip
    model = engine.models.build_model(
        args, "", "dummy", TritonAttention(), 128, torch.bfloat16, "cpu", seed,
        quantization=Fp8Scheme(from_checkpoint=False),
    )  # fmt: skip
    steps = [[(0, 9), (1, 6), (2, 3)], [(0, 1), (1, 1), (2, 1), (3, 12)], [(0, 1), (1, 1)]]
    out = []
    with torch.inference_mode():
        for on in (False, True):
            if on:
                assert model.enable_fp8_fusions()
            reqs = SyntheticRequests(4, 128, 16, 256, seed, "cpu")
            cache = torch.zeros((2, 2, reqs.num_blocks, 16, 2, 16), dtype=FP8_DTYPE)
            logits = []
            for chunks in steps:
                s = reqs.step(chunks)
                hidden = model(s.input_ids, s.positions, cache, s.meta)
                logits.append(model.compute_logits(hidden[s.logits_indices]))
            out.append(torch.cat(logits))
    return {
        "equal": bool(torch.equal(out[0], out[1])),
        "max_diff": float((out[0] - out[1]).abs().max()),
        "fused_calls": calls["fused"],
    }


def run_cases(device: str) -> dict[str, Any]:
    print(f"seeds {SEEDS}", file=sys.stderr)
    return {
        f"{name}/{seed}": fused_mismatch(*spec, device, seed)
        for name, spec in CASES.items()
        for seed in SEEDS
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return interpreted_results(__file__)


def test_tiny_fp8_model_same_logits_with_fusions(interpreted: dict[str, Any]) -> None:
    r = interpreted["model"]
    # the first layer's norm, then per layer the MLP's norm and SiLU, for steps of > 4 rows
    assert r["fused_calls"] > 0, r
    assert r["equal"], r


@pytest.mark.parametrize("name", list(CASES))
def test_fused_kernel_gives_the_unfused_bytes(interpreted: dict[str, Any], name: str) -> None:
    for seed in SEEDS:
        r = interpreted[f"{name}/{seed}"]
        assert r["dtypes_ok"], r
        assert r["q_mismatch"] == 0, r
        assert r["scale_equal"], r
        assert r.get("residual_equal", True), r


if __name__ == "__main__":
    print(json.dumps({**run_cases("cpu"), "model": model_case(SEEDS[0])}))
    sys.exit(0)
