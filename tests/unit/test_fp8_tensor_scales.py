"""Per-tensor FP8 scales (``fp8_scales="tensor"``: engine/models/fp8.py, fp8_loader.py,
triton_fp8_quant.py; docs/quantization.md "Per-tensor scales"), on the CPU.

- The two-launch activation quantization (per-row amax folded by an atomic max, then one
  scale for every row) against ``fp8.quantize_tensor`` through Triton's interpreter in a
  child process (tests/triton_interpreter.py): the scale to float32 rounding, the e4m3
  values at most one step apart (the interpreter truncates float -> e4m3 and drops a
  carry, as tests/unit/test_fp8_quant_kernel.py explains; tests/gpu/test_fp8_tensor_gpu.py
  demands no lost carry). ``run_cases`` is shared with that GPU test.
- The layer: weights with one scale, activations with one dynamic scale, against float64
  of the unquantized product (the bound below), and no host sync on the way (a sync would
  break CUDA-graph capture).
- Requantizing a fused per-tensor checkpoint's parts to their largest scale.
- The tiny Llama's teacher-forced logits and the engine's greedy tokens against the
  unquantized model, at the bounds tests/unit/test_fp8_weights.py holds per channel.
Seeds are fixed.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.triton_interpreter import interpreted_results

# name: (rows, K, dtype, row padding, outlier factor: one element that much above the rest)
CASES: dict[str, tuple[int, int, str, int, float]] = {
    "one_row_bf16": (1, 4096, "bfloat16", 0, 0.0),
    "ragged_k_f32": (5, 1000, "float32", 0, 0.0),
    "strided_rows_bf16": (7, 2112, "bfloat16", 64, 0.0),
    "outlier_token_f16": (6, 512, "float16", 0, 40.0),
    "all_zero_f32": (3, 256, "float32", 0, -1.0),  # -1: the whole tensor is zero
}
SEEDS = (21, 22)


def tensor_quant_mismatch(
    rows: int, k: int, dtype_name: str, pad: int, outlier: float, device: str, seed: int
) -> dict[str, float]:
    import torch

    from engine.models.fp8 import _MIN_SCALE, FP8_MAX, quantize_tensor
    from engine.models.triton_fp8_quant import quantize_tensor_triton
    from tests.fp8_support import e4m3_mismatch

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((rows, k + pad), generator=gen, device=device)
    if outlier > 0:
        x[rows // 2, k // 3] = outlier * float(x.abs().max())
    if outlier < 0:
        x.zero_()
    x = x.to(getattr(torch, dtype_name))[:, :k]
    q, s = quantize_tensor_triton(x, FP8_MAX, _MIN_SCALE)
    q_ref, s_ref = quantize_tensor(x)
    shapes_ok = tuple(s.shape) == (1,) and tuple(s_ref.shape) == (1,)
    return {"scale_shape_ok": float(shapes_ok), **e4m3_mismatch(q, s, q_ref, s_ref)}


def run_cases(device: str) -> dict[str, Any]:
    print(f"seeds {SEEDS}", file=sys.stderr)
    return {
        f"{name}/{seed}": tensor_quant_mismatch(*spec, device, seed)
        for name, spec in CASES.items()
        for seed in SEEDS
    }


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_quant_kernel_matches_torch(interpreted: dict[str, Any], name: str) -> None:
    for seed in SEEDS:
        r = interpreted[f"{name}/{seed}"]
        assert r["dtype_ok"] == 1.0 and r["scale_shape_ok"] == 1.0, r
        assert r["scale_rel_err"] <= 2.0**-22, r
        assert r["max_steps"] <= 1.0 and r["sign_flips"] == 0.0, r
        assert r["mismatch_fraction"] <= 0.06, r


def _weight(n: int, k: int, seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05


def test_tensor_layer_against_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative L2 of the per-tensor layer's output against the float64 product < 0.06
    (two e4m3 roundings of <= 2^-4 each, averaged over K; the per-channel layer is held to
    the same), one weight scale repeated over N rows, and no ``.item()`` / ``bool()`` of
    a tensor on the way (what a CUDA-graph capture forbids)."""
    import torch

    from engine.models.fp8 import Fp8Linear
    from engine.models.layer_ops import TorchOps

    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_weight(48, 64, 3))
    proj = Fp8Linear.quantized(lin, TorchOps, per_tensor=True)
    assert proj.per_tensor and "tensor" in repr(proj)
    assert torch.equal(proj.weight_scale, proj.weight_scale[:1].expand(48))
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))

    def no_sync(*_: object) -> None:
        raise AssertionError("host sync in the per-tensor FP8 path")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_sync)
        m.setattr(torch.Tensor, "__bool__", no_sync)
        m.setattr(torch.Tensor, "tolist", no_sync)
        y = proj(x)
    ref = x.double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    rel = float((y.double() - ref).norm() / ref.norm())
    print("per-tensor layer rel L2:", rel)
    assert 0 < rel < 0.06
    channel = Fp8Linear.quantized(lin, TorchOps)
    assert not channel.per_tensor and not torch.equal(channel(x), y)


def test_fused_checkpoint_parts_requantized_to_the_largest_scale() -> None:
    """q / k / v of a per-tensor checkpoint arrive with three scales; ``use_tensor_scale``
    moves them to the largest: one scale left, each weight within one e4m3 rounding (half
    a step, 2^-4 relative, or half a subnormal step of the new scale) of what it was."""
    import torch

    from engine.models.fp8 import Fp8Linear, quantize_tensor
    from engine.models.layer_ops import TorchOps

    parts = [_weight(16, 32, s) * f for s, f in ((1, 1.0), (2, 0.2), (3, 3.0))]
    proj = Fp8Linear(32, 48, None, TorchOps)
    qs, scales = zip(*(quantize_tensor(p) for p in parts))
    proj.weight.data = torch.cat(qs)
    proj.weight_scale.data = torch.cat([s.expand(16) for s in scales])
    before = proj.weight.float() * proj.weight_scale[:, None]
    proj.use_tensor_scale()
    assert proj.per_tensor
    top = max(float(s) for s in scales)
    assert torch.equal(proj.weight_scale, torch.full((48,), top))
    after = proj.weight.float() * top
    bound = before.abs() * 2.0**-4 + top * 2.0**-10
    assert bool(((after - before).abs() <= bound * (1 + 1e-6)).all())
    assert torch.equal(after[32:], before[32:])  # the part that had the largest is exact


def test_resolve_scales() -> None:
    from engine.models.fp8_loader import resolve_quantization
    from tests.fp8_support import quantization_config

    at_load = resolve_quantization("fp8", {}, "tensor")
    assert at_load is not None and at_load.tensor_scales
    assert not resolve_quantization("fp8", {}).tensor_scales  # type: ignore[union-attr]
    assert resolve_quantization(None, {}, "tensor") is None
    for strategy, expect in (("tensor", True), ("channel", False)):
        cfg = {"quantization_config": quantization_config(strategy)}
        scheme = resolve_quantization(None, cfg, "tensor")
        assert scheme is not None and scheme.tensor_scales is expect
    with pytest.raises(ValueError, match="fp8_scales"):
        resolve_quantization("fp8", {}, "block")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 49152) for _ in range(n - 1)]


def test_tiny_llama_tensor_scales(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Teacher-forced logits at the per-channel test's bounds (rel L2 < 0.06, top-1 >= 0.9
    at load; < 0.08, >= 0.8 from a per-tensor checkpoint), and not the channel logits."""
    from tests.fp8_support import logit_stats, prefill_logits, write_fp8_checkpoint

    toks = _tokens(64)
    ref = prefill_logits(tiny_model_dir, toks)
    tensor = prefill_logits(tiny_model_dir, toks, quantization="fp8", fp8_scales="tensor")
    channel = prefill_logits(tiny_model_dir, toks, quantization="fp8")
    stats = logit_stats(ref, tensor)
    print("tiny llama fp8 per-tensor scales at load:", stats)
    assert 0 < stats["rel_l2"] < 0.06 and stats["top1"] >= 0.9
    assert not bool((tensor == channel).all())
    ckpt = write_fp8_checkpoint(tiny_model_dir, tmp_path / "tensor", "tensor")
    stats = logit_stats(ref, prefill_logits(ckpt, toks, fp8_scales="tensor"))
    print("tiny llama per-tensor checkpoint, tensor scales:", stats)
    assert 0 < stats["rel_l2"] < 0.08 and stats["top1"] >= 0.8


def test_engine_greedy_tensor_scales(tiny_model_dir: Path) -> None:
    """The engine (scheduler, paged cache, decode steps) in tensor mode: its greedy tokens
    are the unquantized model's argmax at >= 85 % of positions (the GPU tests' bound), and
    its KV fingerprint differs from the channel mode's."""
    from engine.core.sampling_params import SamplingParams
    from engine.kv.fingerprint import model_fingerprint
    from engine.llm import LLM
    from engine.models.fp8 import Fp8Linear
    from tests.fp8_support import argmax_agreement

    prompts = [_tokens(9, seed=5), _tokens(21, seed=6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model_dir), quantization="fp8", fp8_scales="tensor") as llm:
        model = llm.engine.runner.model
        projs = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert projs and all(p.per_tensor for p in projs)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        tensor_fp = model_fingerprint(llm.engine.config)
    with LLM(str(tiny_model_dir), quantization="fp8") as channel:
        assert model_fingerprint(channel.engine.config) != tensor_fp
    agree, total = argmax_agreement(tiny_model_dir, prompts, outs, 12)
    print(f"tensor-scale engine greedy vs float argmax: {agree}/{total}")
    assert agree >= 0.85 * total


def test_flag_reaches_the_engine_config(tiny_model_dir: Path) -> None:
    """``--fp8-scales`` on a service sets the engine's field, is forwarded by ``pdserve up``,
    and refuses what is not a choice; unset keeps the engine default (channel)."""
    from tests.engine_flag_support import check_engine_flag

    check_engine_flag(
        tiny_model_dir, "--fp8-scales", "tensor", "fp8_scales", "channel", "block",
        "--quantization", "fp8",
    )  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)
