"""FP8 weights on the GPU (engine/models/fp8.py, triton_fp8_gemv.py; docs/quantization.md).

- The FP8 GEMV: the interpreter's cases (tests/unit/test_fp8_gemv.py) and Llama-3.1-8B's
  projections at 1-4 rows against float64 of the same e4m3 weights (bound stated there;
  half a bf16 ulp, and float32 summation order 2^-16 at K up to 14336).
- ``torch._scaled_mm`` (W8A8, per-token x per-channel scales) against float64 of the same
  quantized operands (summation term 2^-14: Hopper's FP8 MMA does not accumulate in full
  float32; 2^-16 was exceeded by 0.2 % at M = 300), and against the unquantized bf16 product (relative L2 < 0.06: two
  e4m3 roundings of ~2^-4 each, averaged over K; measured ~0.03).
- The GEMV (activations unquantized) against ``_scaled_mm``: they differ by the activation
  quantization only (relative L2 < 0.05).
- Routing: ``fp8_linear`` is the GEMV at <= 4 rows and ``_scaled_mm`` beyond, bit for bit.
- A small random Llama end to end: teacher-forced logits of the FP8 model against bf16
  (relative L2 < 0.08, top-1 >= 0.85), and the graphed FP8 engine's greedy tokens: at
  least 85 % of them are the bf16 model's argmax at the same position.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.unit.test_fp8_gemv import CASES, fp8_bound_ratio, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

SHAPES_8B = {  # name: (M, N, K)
    "qkv_m1": (1, 6144, 4096),
    "o_m2": (2, 4096, 4096),
    "gate_up_m1": (1, 28672, 4096),
    "down_m1": (1, 4096, 14336),
    "down_m4": (4, 4096, 14336),
}
TINY = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from engine.models.fp8 import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn((n, k), generator=gen, device="cuda") * 0.02
    wq, scale = quantize_rows(w)
    return w.bfloat16(), wq, scale


@pytest.fixture(scope="module")
def small_results() -> dict[str, float]:
    return run_cases("cuda", ulp_scale=0.5)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_gemv_small_cases(small_results: dict[str, float], name: str) -> None:
    assert small_results[name] <= 1.0, f"{name}: {small_results[name]:.3g}x the bound"


@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_fp8_gemv_8b_shapes(name: str) -> None:
    from engine.models.triton_fp8_gemv import fp8_gemv

    m, n, k = SHAPES_8B[name]
    _, wq, scale = _weights(n, k, 1)
    x = torch.randn(m, k, device="cuda").bfloat16()
    ratio = fp8_bound_ratio(fp8_gemv(x, wq, scale), x, wq, scale, None, 2.0**-8, 2.0**-16)
    assert ratio <= 1.0, f"{name}: {ratio:.3g}x the bound"


@pytest.mark.parametrize("m", [16, 300])
def test_scaled_mm_against_float64_and_bf16(m: int) -> None:
    from engine.models.fp8 import _scaled_mm, quantize_rows

    w, wq, scale = _weights(4096, 4096, 2)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    y = _scaled_mm(x, wq, scale)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 4096)
    xq, xs = quantize_rows(x)
    ratio = fp8_bound_ratio(
        y, xq.double() * xs.double()[:, None], wq, scale, None, 2.0**-8, 2.0**-14
    )
    assert ratio <= 1.0, f"_scaled_mm: {ratio:.3g}x the bound"
    full = x.double() @ w.double().T
    rel = float((y.double() - full).norm() / full.norm())
    print(f"W8A8 vs bf16 weights, M={m}: relative L2 {rel:.4f}")
    assert 0 < rel < 0.06


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_against_scaled_mm(m: int) -> None:
    from engine.models.fp8 import _scaled_mm
    from engine.models.triton_fp8_gemv import fp8_gemv

    _, wq, scale = _weights(6144, 4096, 3)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    a, b = fp8_gemv(x, wq, scale).double(), _scaled_mm(x, wq, scale).double()
    rel = float((a - b).norm() / b.norm())
    print(f"FP8 GEMV (W8A16) vs _scaled_mm (W8A8), M={m}: relative L2 {rel:.4f}")
    assert 0 < rel < 0.05


def test_fp8_linear_routing() -> None:
    from engine.models.fp8 import _scaled_mm, fp8_linear
    from engine.models.triton_fp8_gemv import launch_fp8_gemv

    _, wq, scale = _weights(512, 256, 4)
    bias = torch.randn(512, device="cuda").bfloat16()
    small, big = (
        torch.randn(3, 256, device="cuda").bfloat16(),
        torch.randn(9, 256, device="cuda").bfloat16(),
    )
    assert torch.equal(
        fp8_linear(small, wq, scale, bias, gemv=True), launch_fp8_gemv(small, wq, scale, bias)
    )
    want = (_scaled_mm(big, wq, scale) + bias).to(torch.bfloat16)
    assert torch.equal(fp8_linear(big, wq, scale, bias, gemv=True), want)
    assert torch.equal(
        fp8_linear(small, wq, scale, bias, gemv=False),
        (_scaled_mm(small, wq, scale) + bias).bfloat16(),
    )


def _save_random_llama(out: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


def test_small_model_fp8_against_bf16(tmp_path: Path) -> None:
    from tests.fp8_support import argmax_agreement, graphed_greedy, logit_stats, prefill_logits

    model_dir = _save_random_llama(tmp_path / "tiny", 7)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(96)]
    kw = {"device": "cuda", "dtype": torch.bfloat16, "backend_name": "triton"}
    ref = prefill_logits(model_dir, prompt, **kw)  # type: ignore[arg-type]
    q = prefill_logits(model_dir, prompt, quantization="fp8", **kw)  # type: ignore[arg-type]
    stats = logit_stats(ref, q)
    print("tiny bf16 vs fp8, teacher-forced:", stats)
    assert 0 < stats["rel_l2"] < 0.08 and stats["top1"] >= 0.85

    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 77)]
    outs = graphed_greedy(model_dir, prompts, 24, quantization="fp8")
    agree, total = argmax_agreement(model_dir, prompts, outs, 24, **kw)
    print(f"graphed FP8 engine greedy vs bf16 argmax: {agree}/{total}")
    assert agree >= 0.85 * total


def test_activation_quant_kernel_matches_torch() -> None:
    """The one-launch activation quantization (engine/models/triton_fp8_quant.py) equals
    ``quantize_rows`` on the GPU, where both round to nearest even: scales to float32
    rounding, no lost carry, at most one e4m3 step apart on a rare boundary element."""
    from tests.unit.test_fp8_quant_kernel import run_cases as run_quant_cases

    for case, r in run_quant_cases("cuda").items():
        assert r["dtype_ok"] == 1.0, case
        assert r["scale_rel_err"] <= 2.0**-22, (case, r)
        assert r["carry_lost"] == 0.0, (case, r)
        assert r["max_steps"] <= 1.0, (case, r)
        assert r["mismatch_fraction"] <= 0.002, (case, r)
