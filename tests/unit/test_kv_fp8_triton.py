"""FP8 (e4m3) KV cache in the Triton kernels, under Triton's interpreter, against the torch
reference backend reading the same fp8 cache and against float64 attention over the
unquantized K/V (docs/design.md §3 "KV cache dtype").

Like tests/unit/test_triton_interpret.py, the kernels run in one child process (this file
as a script, TRITON_INTERPRET=1). The same cases run on the GPU in
tests/gpu/test_kv_fp8_gpu.py through ``run_case(..., device="cuda")``.

Per case: the write kernel must store exactly the bytes ``kv_quant.quantize`` gives (the
torch path's write), the attention must match the torch reference over that fp8 cache to
the model dtype's usual tolerance, and its error against the unquantized truth must stay
under the fp8 bound. Scales other than 1.0 (powers of two, so division is exact on every
device) check that k_scale/v_scale reach the right places.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# id: (q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale, splits)
CASES: dict[str, tuple[list[int], list[int], int, int, int, int, str, float, float, int]] = {
    "decode_g1_f32": ([1, 1, 1], [0, 20, 47], 4, 4, 64, 16, "float32", 1.0, 1.0, 0),
    "mixed_g4_f32_scaled": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "float32", 0.5, 2.0, 0),
    "mixed_g4_bf16": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "bfloat16", 1.0, 1.0, 0),
    "chunked_g3_d128_bf16_scaled": ([24, 1], [40, 64], 6, 2, 128, 32, "bfloat16", 2.0, 0.25, 0),
    "long_split4_g8_f32": ([1, 1], [300, 17], 8, 1, 64, 16, "float32", 1.0, 0.5, 4),
    "tiny_model_d16_g2": ([6, 1], [0, 40], 4, 2, 16, 16, "float32", 1.0, 1.0, 0),
}
# Triton vs the torch reference over the same fp8 cache: both dequantize exactly, so only
# summation order and (bf16) the rounding of P differ.
TOL_VS_TORCH = {"float32": 1e-5, "bfloat16": 1.5e-2}
# Against float64 attention over the unquantized K/V: e4m3 keeps 3 mantissa bits (relative
# rounding error <= 2**-4 per element); measured 2.7-3.7e-2 on these random cases.
TOL_VS_TRUTH = 6e-2
# bf16 cases run again with the e4m3 tiles converted to fp16 (the query pre-scaled).
F16_CASES = [name for name, spec in CASES.items() if spec[6] == "bfloat16"]


def run_case(
    spec: tuple[list[int], list[int], int, int, int, int, str, float, float, int],
    seed: int,
    device: str,
    f16_kv: bool = False,
) -> dict[str, float]:
    """Write + attention through the Triton kernels and the torch reference on ``device``;
    returns the byte mismatches of the writes and both relative errors. ``f16_kv``: the
    attention converts the e4m3 tiles to fp16 (``paged_attention``'s option)."""
    import torch

    from engine.attention.kv_quant import FP8_DTYPE, quantize
    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import (
        LaunchConfig,
        paged_attention,
        validate_inputs,
        write_kv_cache,
    )
    from engine.attention.triton_testing import make_case, reference_attention, relative_error

    q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, k_scale, v_scale, splits = spec
    case = make_case(
        q_lens, cached, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=getattr(torch, dtype), device=device, seed=seed,
    )  # fmt: skip
    # The cached tokens as an fp8 cache holds them; unused slots stay NaN (e4m3fn has NaN),
    # so a read outside a context still poisons the output.
    fp8 = torch.stack(
        [
            quantize(case.kv_cache[0], FP8_DTYPE, k_scale),
            quantize(case.kv_cache[1], FP8_DTYPE, v_scale),
        ]
    )
    triton_cache, torch_cache = fp8.clone(), fp8.clone()
    validate_inputs(case.query, case.key, triton_cache)
    write_kv_cache(case.key, case.value, triton_cache, case.meta.slot_mapping, k_scale, v_scale)
    config = None
    if splits:
        group = heads // kv_heads
        config = LaunchConfig(
            block_q=1, block_m=max(16, 1 << (group - 1).bit_length()), block_n=16,
            num_splits=splits, decode_only=True,
        )  # fmt: skip
    out = paged_attention(
        case.query, triton_cache, case.meta, case.scale, num_sms=None if device == "cpu" else
        torch.cuda.get_device_properties(0).multi_processor_count, config=config,
        k_scale=k_scale, v_scale=v_scale, f16_kv=f16_kv,
    )  # fmt: skip
    ref_backend = TorchRefAttention(cpu_kernels=False, k_scale=k_scale, v_scale=v_scale)
    # The torch reference gathers whole blocks and masks afterwards, so NaN sentinels in
    # unused slots would reach it as NaN * 0: it gets zeros there instead.
    torch_cache = torch.where(torch_cache.float().isnan(), 0.0, torch_cache.float()).to(FP8_DTYPE)
    ref = ref_backend.forward(case.query, case.key, case.value, torch_cache, case.meta, case.scale)
    # Compare the bytes where either write landed (the sentinels differ by construction).
    written = torch.zeros(triton_cache.shape[1:3].numel(), dtype=torch.bool, device=device)
    slots = case.meta.slot_mapping
    written[slots[slots >= 0]] = True
    written = written.view(triton_cache.shape[1:3])[None, :, :, None, None]
    written = written.expand_as(triton_cache)
    a, b = triton_cache.view(torch.uint8)[written], torch_cache.view(torch.uint8)[written]
    truth = reference_attention(case, device)
    return {
        "write_byte_mismatches": int((a != b).sum()),
        "err_vs_torch": relative_error(out, ref.double()),
        "torch_err_vs_truth": relative_error(ref, truth),
        "err_vs_truth": relative_error(out, truth),
    }


def run_rope_store_case(seed: int, device: str, dtype_name: str) -> dict[str, float]:
    """The fused RoPE + K/V store into an fp8 cache vs the torch reference's rope + store:
    the bytes written must be identical (k rounded to the model dtype, then quantized)."""
    import torch

    from engine.attention.kv_quant import FP8_DTYPE
    from engine.models.layer_ops import TorchOps
    from engine.models.rope import RotaryEmbedding
    from engine.models.triton_ops import TritonOps

    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    n, hq, hk, d, bs = 21, 4, 2, 64, 16
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=device).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d) * 3  # some values beyond e4m3's fine range
    k = k.contiguous()
    v = qkv[:, (hq + hk) * d :].view(n, hk, d)
    rope = RotaryEmbedding(d, 4096, 500000.0, {}).to(device)
    pos = torch.randint(0, 4096, (n,), device=device)
    blocks = -(-n // bs) + 2
    slots = torch.randperm(blocks * bs, device=device)[:n]
    slots[1::3] = -1
    cache0 = torch.randn((2, blocks, bs, hk, d), device=device).to(FP8_DTYPE)
    fused, ref = cache0.clone(), cache0.clone()
    fq = TritonOps.rope_store_kv(pos, q, k, v, rope.cos, rope.sin, fused, slots, 0.5, 2.0)
    rq = TorchOps.rope_store_kv(pos, q, k, v, rope.cos, rope.sin, ref, slots, 0.5, 2.0)
    # Changed positions outside the written slots (a difference of two change counts could
    # be off by one whenever a written byte happens to equal the old one).
    written = torch.zeros(blocks * bs, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    outside = ~written.view(1, blocks, bs, 1, 1).expand_as(fused)
    changed = fused.view(torch.uint8) != cache0.view(torch.uint8)
    return {
        "cache_byte_mismatches": int((fused.view(torch.uint8) != ref.view(torch.uint8)).sum()),
        "untouched_changed": int((changed & outside).sum()),
        "q_max_diff": float((fq.float() - rq.float()).abs().max()),
    }


def main() -> None:
    """Child process: every case on inputs from the fixed test seed; prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    results: dict[str, Any] = {
        name: run_case(spec, seed + i, "cpu") for i, (name, spec) in enumerate(CASES.items())
    }
    for i, name in enumerate(F16_CASES):
        results[name + "/f16"] = run_case(CASES[name], seed + i, "cpu", f16_kv=True)
    results["rope_store_f32"] = run_rope_store_case(seed, "cpu", "float32")
    print(json.dumps({"seed": seed, "results": results}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    payload, _ = run_interpreted(__file__)
    print(f"seed {payload['seed']}")
    results: dict[str, Any] = payload["results"]
    return results


def check_case(name: str, res: dict[str, float], dtype: str) -> None:
    """The assertions shared with the GPU test."""
    assert res["write_byte_mismatches"] == 0, f"{name}: fp8 write differs from quantize()"
    assert res["err_vs_torch"] < TOL_VS_TORCH[dtype], (
        f"{name}: triton vs torch reference over the fp8 cache: {res['err_vs_torch']:.3e} "
        "(NaN = read outside the context)"
    )
    assert res["err_vs_truth"] < TOL_VS_TRUTH, f"{name}: fp8 error {res['err_vs_truth']:.3e}"
    assert res["torch_err_vs_truth"] < TOL_VS_TRUTH, f"{name}: {res['torch_err_vs_truth']:.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_kernels_match_reference(interpreted: dict[str, Any], name: str) -> None:
    check_case(name, interpreted[name], CASES[name][6])


@pytest.mark.parametrize("name", F16_CASES)
def test_fp8_kernels_with_fp16_tiles_match_reference(
    interpreted: dict[str, Any], name: str
) -> None:
    check_case(name + "/f16", interpreted[name + "/f16"], CASES[name][6])


def test_fused_rope_store_quantizes_like_torch(interpreted: dict[str, Any]) -> None:
    res = interpreted["rope_store_f32"]
    assert res["cache_byte_mismatches"] == 0, res
    assert res["untouched_changed"] == 0, res
    assert res["q_max_diff"] < 1e-5, res


if __name__ == "__main__":
    main()
