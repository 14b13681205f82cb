"""The fused RoPE + paged-KV-store kernel (``TritonOps.rope_store_kv``) on the CPU, through
Triton's interpreter, against the two paths it replaces: the unfused Triton kernels (RoPE,
then the attention backend's KV write) and the torch reference (``TorchOps.rope_store_kv``).

As in test_triton_layer_ops.py, the cases run in one child process (this file as a script)
that prints JSON. ``run_cases`` is shared with tests/gpu/test_rope_store_kv_gpu.py, which
runs the same checks at Llama-3-8B head shapes on the GPU.

What is exact and what is not: the fused kernel rounds where the RoPE kernel rounds and
stores its output unchanged, so against the unfused Triton path every bit of q and of the
cache must match, in every dtype, on any device. Against torch it depends on the compiler:

* Under the interpreter float32 and float16 match ``TorchOps`` bit for bit, but casts to
  bfloat16 truncate instead of rounding to nearest (checked on every cast). A bf16 case
  must match bit for bit the torch chain with truncating casts (``_torch_truncating``),
  which pins down that the kernel rounds exactly where torch does, and ``TorchOps``
  within the few truncated ulps.
* On the GPU (H200, Triton 3.6) the compiler folds a rounded product into the following
  add as one FMA, so one product's rounding is lost, in the existing RoPE kernel as in
  this one: about an ulp of the output against ``TorchOps`` in bf16/fp16 and a float32
  rounding in float32, hence the GPU bounds below. (Rounding on the float32 bits rather
  than through a bf16 cast matched torch on every element in a standalone check.)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

# name: (tokens, (q_heads, kv_heads, head_dim), dtype, block_size)
SMALL_CASES: dict[str, tuple[int, tuple[int, int, int], str, int]] = {
    "gqa_f32": (7, (4, 2, 64), "float32", 4),
    "gqa_bf16": (8, (6, 2, 32), "bfloat16", 8),
    "mha3_d128_bf16": (4, (3, 3, 128), "bfloat16", 2),  # 3 KV heads: masked head rows
    "mqa_f16": (5, (4, 1, 64), "float16", 16),
}
# Largest |fused - torch| over the reference's largest magnitude where bits may differ:
# bf16 under the interpreter (the bound of test_triton_layer_ops.py's RoPE cases), and the
# GPU's lost product rounding: half an ulp of a product (|product| <= max|x| <= sqrt(2)
# max|out|, a rotation keeps each pair's norm) plus one ulp of the output's rounding is
# under two ulps of the dtype. On an H200 the largest seen was 0.85 ulp (bf16, 8B
# prefill). float32 as in test_layer_ops_gpu.py.
INTERP_BF16_TOL = 2**-5
GPU_TORCH_TOL = {"float32": 2e-6, "bfloat16": 2 * 2**-7, "float16": 2 * 2**-10}


def _bits(t: Any) -> Any:
    """The tensor's raw bits, so equality also tells -0.0 from 0.0."""
    import torch

    ints = {2: torch.int16, 4: torch.int32}
    return t.contiguous().view(ints[t.element_size()])


def _same(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _max_rel(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _torch_truncating(
    positions: Any, q: Any, k: Any, v: Any, cos: Any, sin: Any, cache: Any, slots: Any
) -> Any:
    """``TorchOps.rope_store_kv`` in bf16 with each cast truncating, as the interpreter's:
    every product and sum computed in float32 and cut to bf16 where torch rounds it."""
    import torch

    from engine.models.layer_ops import store_kv

    def cut(x: Any) -> Any:
        return (x.float().view(torch.int32) & -65536).view(torch.float32)

    half = q.shape[-1] // 2
    c, s = cut(cos[positions]).unsqueeze(1), cut(sin[positions]).unsqueeze(1)

    def rot(x: Any) -> Any:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        out1 = cut(cut(x1 * c[..., :half]) + cut(-x2 * s[..., :half]))
        out2 = cut(cut(x2 * c[..., half:]) + cut(x1 * s[..., half:]))
        return torch.cat([out1, out2], dim=-1).to(torch.bfloat16)  # exact: already cut

    store_kv(cache, rot(k), v, slots)
    return rot(q)


def _kernel_case(
    n: int, heads: tuple[int, int, int], dtype_name: str, block_size: int, device: str, seed: int
) -> dict[str, Any]:
    import torch

    from engine.attention.triton_backend import write_kv_cache
    from engine.models.layer_ops import TorchOps
    from engine.models.rope import RotaryEmbedding
    from engine.models.triton_ops import TritonOps

    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    hq, hk, d = heads
    # q, k, v as the model sees them: strided views of one fused projection output.
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=device).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d :].view(n, hk, d)
    rope = RotaryEmbedding(d, 4096, 500000.0, {}).to(device)
    pos = torch.randint(0, 4096, (n,), device=device)
    num_blocks = -(-n // block_size) + 2
    # Distinct random slots over shuffled blocks; every third token is padding (-1).
    slots = torch.randperm(num_blocks * block_size, device=device)[:n]
    slots[1::3] = -1
    # Random (not NaN) contents, so untouched slots can be compared bit for bit.
    cache0 = torch.randn((2, num_blocks, block_size, hk, d), device=device).to(dtype)

    fused_cache = cache0.clone()
    fused_q = TritonOps.rope_store_kv(pos, q, k, v, rope.cos, rope.sin, fused_cache, slots)
    unfused_cache = cache0.clone()
    unfused_q, rot_k = TritonOps.rope(pos, q, k, rope.cos, rope.sin)
    write_kv_cache(rot_k, v, unfused_cache, slots)
    torch_cache = cache0.clone()
    torch_q = TorchOps.rope_store_kv(pos, q, k, v, rope.cos, rope.sin, torch_cache, slots)
    trunc_equal = None
    if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's casts
        trunc_cache = cache0.clone()
        trunc_q = _torch_truncating(pos, q, k, v, rope.cos, rope.sin, trunc_cache, slots)
        trunc_equal = _same(fused_q, trunc_q) and _same(fused_cache, trunc_cache)

    # Only the valid slots may change, and nothing from a -1 row may land anywhere.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat0 = cache0.view(2, -1, hk, d)
    flat = fused_cache.view(2, -1, hk, d)
    untouched = _same(flat[:, ~written], flat0[:, ~written])
    stored_v = _same(flat[1, slots[slots >= 0]], v[slots >= 0])

    # A non-contiguous cache (head_dim sliced out of a wider buffer) takes the fallback.
    wide = torch.cat([cache0, cache0], dim=-1)
    strided_cache = wide[..., :d]
    fb_q = TritonOps.rope_store_kv(pos, q, k, v, rope.cos, rope.sin, strided_cache, slots)
    return {
        "q_contiguous": fused_q.is_contiguous() and fused_q.shape == (n, hq, d),
        "unfused_equal": _same(fused_q, unfused_q) and _same(fused_cache, unfused_cache),
        "torch_equal": _same(fused_q, torch_q) and _same(fused_cache, torch_cache),
        "torch_rel": max(_max_rel(fused_q, torch_q), _max_rel(fused_cache, torch_cache)),
        "trunc_equal": trunc_equal,
        "untouched": untouched,
        "stored_v": stored_v,
        "fallback_equal": _same(fb_q, unfused_q) and _same(strided_cache, unfused_cache),
    }


def _model_case(
    q_lens: list[int], cached: list[int], dtype_name: str, device: str, seed: int
) -> dict[str, Any]:
    """A tiny Llama (2 layers, head_dim 16) over the Triton backend, fused vs unfused, on
    one mixed batch with a padding row; float32 also against torch_ref + TorchOps."""
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import TritonAttention
    from engine.attention.triton_testing import make_case
    from engine.models.layer_ops import TorchOps
    from engine.models.triton_ops import TritonOps
    from tests.unit.test_triton_layer_ops import tiny_llama

    class UnfusedTritonOps(TritonOps):
        """The same kernels, but the model takes the old rope + backend-write path."""

        fuses_kv_write = False

    class CountingTritonAttention(TritonAttention):
        """The real backend, recording which entry point the model used."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            self.calls.append("forward")
            return super().forward(*args, **kwargs)

        def forward_prewritten(self, *args: Any, **kwargs: Any) -> Any:
            self.calls.append("prewritten")
            return super().forward_prewritten(*args, **kwargs)

    dtype = getattr(torch, dtype_name)
    case = make_case(
        q_lens, cached, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=dtype, device=device, seed=seed, pad_tokens=1,
    )  # fmt: skip
    real = sum(q_lens)
    # Each request's queries are its last positions; the padding row gets position 0.
    positions = torch.cat(
        [torch.arange(c, c + q) for c, q in zip(cached, q_lens, strict=True)]
        + [torch.zeros(1, dtype=torch.int64)]
    ).to(device)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (real + 1,), generator=gen).to(device)
    # Random cache contents stand for the cached prefixes (the same in every run).
    cache0 = torch.randn((2, *case.kv_cache.shape), generator=gen).to(dtype).to(device)
    fused, unfused = CountingTritonAttention(), CountingTritonAttention()
    runs: dict[str, tuple[Any, Any]] = {
        "fused": (TritonOps, fused),
        "unfused": (UnfusedTritonOps, unfused),
        "torch": (TorchOps, TorchRefAttention(cpu_kernels=False)),
    }
    if dtype != torch.float32:
        del runs["torch"]  # bf16 against torch is the kernel cases' job
    logits, caches = {}, {}
    for name, (ops, backend) in runs.items():
        model = tiny_llama(dtype, device, ops, backend, seed)
        cache = cache0.clone()
        with torch.inference_mode():
            hidden = model(ids, positions, cache, case.meta)
            # The padding row's output is never read (and may be garbage): real rows only.
            logits[name] = model.compute_logits(hidden[:real])
        caches[name] = cache
    out: dict[str, Any] = {
        "logits_equal": _same(logits["fused"], logits["unfused"]),
        "cache_equal": _same(caches["fused"], caches["unfused"]),
        "cache_written": not _same(caches["fused"], cache0),
        "fused_calls": fused.calls,
        "unfused_calls": unfused.calls,
    }
    if "torch" in runs:
        out["torch_rel"] = _max_rel(logits["fused"], logits["torch"])
    return out


# name: (q_lens, cached, dtype)
MODEL_CASES: dict[str, tuple[list[int], list[int], str]] = {
    "model_mixed_f32": ([5, 1], [0, 6], "float32"),
    "model_decode_bf16": ([1, 1, 1], [3, 9, 0], "bfloat16"),
}


def run_cases(
    kernel_cases: dict[str, tuple[int, tuple[int, int, int], str, int]],
    model_cases: dict[str, tuple[list[int], list[int], str]],
    device: str,
) -> dict[str, dict[str, Any]]:
    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    results = {
        name: _kernel_case(*spec, device, seed + i)
        for i, (name, spec) in enumerate(kernel_cases.items())
    }
    for i, (name, mspec) in enumerate(model_cases.items()):
        results[name] = _model_case(*mspec, device, seed + 100 + i)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_rope_store_kv_kernel(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    r = interpreted[name]
    assert r["q_contiguous"], "q must come back contiguous [tokens, q_heads, head_dim]"
    assert r["unfused_equal"], "q or cache differs from the rope + write_kv_cache kernels"
    assert r["untouched"], "a slot outside the valid slot_mapping entries changed"
    assert r["stored_v"], "v was not stored unchanged at its slot"
    assert r["fallback_equal"], "the non-contiguous-cache fallback differs"
    if SMALL_CASES[name][2] == "bfloat16":
        assert r["trunc_equal"], "q or cache differs from torch with the interpreter's casts"
        assert r["torch_rel"] < INTERP_BF16_TOL, f"vs TorchOps: {r['torch_rel']:.3e}"
    else:
        assert r["torch_equal"], f"q or cache differs from TorchOps ({r['torch_rel']:.3e})"


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_tiny_model_fused_equals_unfused(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    r = interpreted[name]
    assert r["fused_calls"] == ["prewritten"] * 2, "the fused run must skip the backend write"
    assert r["unfused_calls"] == ["forward"] * 2
    assert r["cache_written"]
    assert r["cache_equal"], "the fused path left a different KV cache"
    assert r["logits_equal"], "fused-path logits differ from the unfused path"
    if "torch_rel" in r:
        assert r["torch_rel"] < 1e-5, f"vs torch_ref + TorchOps: {r['torch_rel']:.3e}"


def test_model_picks_fused_path_only_with_both_sides() -> None:
    """The model fuses only when the ops fuse the write and the backend takes a
    prewritten cache; torch_ref and TorchOps keep the backend's own write."""
    from engine.attention.base import AttentionBackend
    from engine.attention.torch_ref import TorchRefAttention
    from engine.models.layer_ops import TorchOps

    assert TorchOps.fuses_kv_write is False
    assert TorchRefAttention.accepts_prewritten_kv is False
    assert AttentionBackend.accepts_prewritten_kv is False


def test_torch_store_kv_skips_negative_slots() -> None:
    """The reference store itself: rows at slot -1 leave the cache as it was."""
    import torch

    from engine.models.layer_ops import store_kv

    cache = torch.randn(2, 3, 4, 2, 8)
    before = cache.clone()
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv(cache, k, v, torch.tensor([5, -1, 11]))
    flat, flat0 = cache.view(2, 12, 2, 8), before.view(2, 12, 2, 8)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 11], v[2])
    others = [i for i in range(12) if i not in (5, 11)]
    assert torch.equal(flat[:, others], flat0[:, others])


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(run_cases(SMALL_CASES, MODEL_CASES, "cpu")))
