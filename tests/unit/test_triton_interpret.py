"""The Triton attention kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

The interpreter must be switched on before triton is first imported, and another test in
the same pytest process may already have imported it, so the kernels run in one child
process (this file run as a script) that prints one JSON result per case; each case is
then its own test here. Shapes are small; the same cases at full size run on the GPU in
tests/gpu/test_triton_attention.py.

In the interpreter, bf16 operands of ``tl.dot`` are upcast to fp32 first (its ``tl.dot``
multiplies raw bf16 bit patterns); the bf16 loads, the rounding of P and the stores are
still exercised, and the GPU tests cover the bf16 tensor-core path.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# id: (q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, forced splits or 0, pad)
CASES: dict[str, tuple[list[int], list[int], int, int, int, int, str, int, int]] = {
    "decode_g1_f32": ([1, 1, 1], [0, 20, 47], 4, 4, 64, 16, "float32", 0, 0),
    "decode_g1_bf16": ([1, 1, 1], [5, 20, 47], 4, 4, 64, 16, "bfloat16", 0, 0),
    "mixed_g4_f32": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "float32", 0, 0),
    "mixed_g4_bf16": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "bfloat16", 0, 0),
    "chunked_g3_d128_f32": ([24, 1], [40, 64], 6, 2, 128, 32, "float32", 0, 0),
    "chunked_g3_d128_bf16": ([24, 1], [40, 64], 6, 2, 128, 32, "bfloat16", 0, 0),
    "prefill_multi_qblock_g8": ([50], [0], 8, 1, 64, 16, "float32", 0, 0),
    "prefix_hit_bs64": ([7, 3], [64, 128], 4, 2, 64, 64, "bfloat16", 0, 0),
    "long_split4_g8_f32": ([1, 1], [300, 17], 8, 1, 64, 16, "float32", 4, 0),
    "long_split4_g8_bf16": ([1, 1], [300, 17], 8, 1, 64, 16, "bfloat16", 4, 0),
    "split_more_than_tiles": ([1, 1, 1], [0, 5, 40], 4, 2, 128, 16, "float32", 8, 0),
    "mixed_split3": ([12, 1, 5], [20, 70, 0], 4, 1, 64, 32, "float32", 3, 0),
    "tiny_model_d16_g2": ([6, 1], [0, 40], 4, 2, 16, 16, "float32", 0, 0),
    "padding_rows": ([4, 1], [3, 9], 4, 2, 64, 16, "float32", 0, 3),
    "decode_padding_rows_split": ([1, 1], [30, 9], 4, 2, 64, 16, "bfloat16", 2, 2),
    # head_dim not a power of two (Phi-3-mini's 96): tiles padded to 128
    "mixed_d96_g4_f32": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 96, 16, "float32", 0, 0),
    "decode_d96_split3_bf16": ([1, 1], [300, 17], 8, 1, 96, 16, "bfloat16", 3, 0),
    "chunked_d80_f32": ([24, 1], [40, 64], 6, 2, 80, 32, "float32", 0, 0),
}
TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def _run_case(
    spec: tuple[list[int], list[int], int, int, int, int, str, int, int], seed: int
) -> dict[str, float]:
    import torch

    from engine.attention.triton_backend import (
        LaunchConfig,
        paged_attention,
        validate_inputs,
        write_kv_cache,
    )
    from engine.attention.triton_testing import (
        cache_error,
        make_case,
        reference_attention,
        relative_error,
    )

    q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, splits, pad = spec
    case = make_case(
        q_lens,
        cached,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=getattr(torch, dtype),
        device="cpu",
        seed=seed,
        pad_tokens=pad,
    )
    validate_inputs(case.query, case.key, case.kv_cache)
    write_kv_cache(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    config = None
    if splits:
        group = heads // kv_heads
        decode = case.meta.max_query_len == 1
        block_m = max(16, 1 << (group - 1).bit_length())
        config = LaunchConfig(
            block_q=1 if decode else max(1, block_m // group),
            block_m=block_m,
            block_n=16,
            num_splits=splits,
            decode_only=decode,
        )
    out = paged_attention(
        case.query, case.kv_cache, case.meta, case.scale, num_sms=None, config=config
    )
    real = sum(q_lens)  # padding rows belong to no request: their output is unspecified
    ref = reference_attention(case)[:real]
    return {"err": relative_error(out[:real], ref), "cache_err": cache_error(case)}


def main() -> None:
    """Child process: run every case on inputs from the fixed test seed, print
    {id: result} as JSON."""
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    results = {name: _run_case(spec, seed + i) for i, (name, spec) in enumerate(CASES.items())}
    print(json.dumps({"seed": seed, "results": results}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, float]]:
    payload, _ = run_interpreted(__file__)
    print(f"seed {payload['seed']}")
    results: dict[str, dict[str, float]] = payload["results"]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(interpreted: dict[str, dict[str, float]], name: str) -> None:
    res = interpreted[name]
    tol = TOL[CASES[name][6]]
    assert res["cache_err"] == 0.0, f"{name}: K/V written wrong (max abs err {res['cache_err']})"
    assert res["err"] < tol, (
        f"{name}: relative error {res['err']:.3e} >= {tol} (NaN = read outside the context)"
    )


def test_cpu_tensors_without_interpreter_are_refused() -> None:
    import torch

    from engine.attention.triton_backend import validate_inputs

    q = torch.zeros(2, 4, 64)
    k = torch.zeros(2, 2, 64)
    cache = torch.zeros(2, 4, 16, 2, 64)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("run this test without TRITON_INTERPRET=1: it checks the refusal")
    with pytest.raises(ValueError, match="CUDA"):
        validate_inputs(q, k, cache)


@pytest.mark.parametrize(
    ("q_shape", "kv_heads", "head_dim", "block_size", "match"),
    [
        ((2, 4, 44), 2, 44, 16, "head_dim"),
        ((2, 6, 64), 4, 64, 16, "multiple"),
        ((2, 4, 64), 2, 64, 24, "block_size"),
    ],
)
def test_bad_shapes_are_refused(
    monkeypatch: pytest.MonkeyPatch,
    q_shape: tuple[int, int, int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    match: str,
) -> None:
    import torch

    from engine.attention.triton_backend import validate_inputs

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # pass the device check; shapes are what is tested
    q = torch.zeros(q_shape)
    k = torch.zeros(q_shape[0], kv_heads, head_dim)
    cache = torch.zeros(2, 4, block_size, kv_heads, head_dim)
    with pytest.raises(ValueError, match=match):
        validate_inputs(q, k, cache)


if __name__ == "__main__":
    main()
