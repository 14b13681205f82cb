"""Deterministic mode's Triton kernels on the CPU, through Triton's interpreter
(docs/design.md §3 "Deterministic mode"): a row's output bits do not depend on the rows
launched with it.

- ``bi_linear``: each row of a 64-row batch equals the row computed alone and at another
  position of another batch, bit for bit, and matches a float64 reference;
- the RMSNorm kernel: the same, row alone vs in the batch;
- paged attention with ``invariant_config``: each request of a mixed batch (prefills,
  chunked prefills, decodes) equals the request launched alone, and a chunked prefill cut
  at another point gives the same rows.

The kernels run in a child process (tests/triton_interpreter.py explains why); the same
properties at full size on a GPU: tests/gpu/test_deterministic_gpu.py.
"""

from __future__ import annotations

import json

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import ROW_INVARIANT_BLAS, run_interpreted

DTYPES = ("float32", "bfloat16")


def _linear_case(dtype_name: str, seed: int) -> dict[str, float | bool]:
    import torch

    from engine.models.triton_batch_invariant import bi_linear

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    n, k = 48, 200  # K not a multiple of the tile: the masked tail is in every row's sum
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(64, k, generator=gen).to(dtype)
    batch = bi_linear(x, w, b)
    alone = torch.cat([bi_linear(x[i : i + 1], w, b) for i in range(64)])
    shuffled = x[torch.randperm(64, generator=gen)[:37]]
    idx = [int((x == row).all(1).nonzero()[0]) for row in shuffled]
    other = bi_linear(shuffled, w, b)
    ref = x.double() @ w.double().T + b.double()
    err = float((batch.double() - ref).norm() / ref.norm())
    return {
        "alone_equal": bool(torch.equal(batch, alone)),
        "other_batch_equal": bool(torch.equal(other, batch[idx])),
        "err": err,
    }


def _rms_case(dtype_name: str, seed: int) -> dict[str, float | bool]:
    import torch

    from engine.models.triton_ops import TritonOps

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    batch = TritonOps.rms_norm(x, w, 1e-6)
    alone = torch.cat([TritonOps.rms_norm(x[i : i + 1], w, 1e-6) for i in range(64)])
    return {"alone_equal": bool(torch.equal(batch, alone))}


def _sub_meta(meta, r: int, q0: int, q1: int, seq_len: int):  # noqa: ANN001, ANN202
    """Metadata for request ``r`` alone, with query rows ``q0:q1`` of it and context
    ``seq_len`` (the cache already holds every token)."""
    import torch

    from engine.attention.base import AttentionMetadata

    q_len = q1 - q0
    return AttentionMetadata(
        slot_mapping=torch.full((q_len,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=meta.block_tables[r : r + 1].clone(),
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, q_len],
        seq_lens_cpu=[seq_len],
    )


def _attention_case(dtype_name: str, seed: int) -> dict[str, float | bool]:
    import torch

    from engine.attention.triton_backend import TritonAttention, write_kv_cache
    from engine.attention.triton_testing import make_case, reference_attention, relative_error

    q_lens, cached = [9, 1, 23, 1, 1, 5], [0, 30, 16, 70, 5, 40]
    case = make_case(q_lens, cached, num_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=16, dtype=getattr(torch, dtype_name), device="cpu",
                     seed=seed)  # fmt: skip
    write_kv_cache(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    backend = TritonAttention(batch_invariant=True)
    batch = backend.forward_prewritten(case.query, case.kv_cache, case.meta, case.scale)
    qsl, lens = case.meta.query_start_loc_cpu, case.meta.seq_lens_cpu
    alone_equal = True
    for r in range(len(q_lens)):
        meta = _sub_meta(case.meta, r, qsl[r], qsl[r + 1], lens[r])
        alone = backend.forward_prewritten(case.query[qsl[r] : qsl[r + 1]], case.kv_cache,
                                           meta, case.scale)  # fmt: skip
        alone_equal &= torch.equal(alone, batch[qsl[r] : qsl[r + 1]])
    # Request 2 (16 cached + 23 new) prefilled in two chunks cut after 11 new tokens.
    r, cut = 2, 11
    q0 = qsl[r]
    first = _sub_meta(case.meta, r, q0, q0 + cut, cached[r] + cut)
    second = _sub_meta(case.meta, r, q0 + cut, qsl[r + 1], lens[r])
    chunked = torch.cat((
        backend.forward_prewritten(case.query[q0 : q0 + cut], case.kv_cache, first, case.scale),
        backend.forward_prewritten(case.query[q0 + cut : qsl[r + 1]], case.kv_cache, second,
                                   case.scale),
    ))  # fmt: skip
    return {
        "alone_equal": alone_equal,
        "chunked_equal": bool(torch.equal(chunked, batch[q0 : qsl[r + 1]])),
        "err": relative_error(batch, reference_attention(case)),
    }


CASES = {"linear": _linear_case, "rms_norm": _rms_case, "attention": _attention_case}


def main() -> None:
    """Child process: every case in every dtype on inputs from the fixed test seed, as JSON."""
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    results = {
        f"{name}_{dtype}": fn(dtype, seed + i)
        for i, (name, fn) in enumerate(CASES.items())
        for dtype in DTYPES
    }
    print(json.dumps({"seed": seed, "results": results}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, float | bool]]:
    payload, _ = run_interpreted(__file__, extra_env=ROW_INVARIANT_BLAS)
    print(f"seed {payload['seed']}")
    return dict(payload["results"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bi_linear_rows_do_not_depend_on_the_batch(interpreted: dict, dtype: str) -> None:
    res = interpreted[f"linear_{dtype}"]
    assert res["alone_equal"], "a row computed alone differs from the same row in a batch"
    assert res["other_batch_equal"], "a row differs at another position of another batch"
    assert res["err"] < (1e-6 if dtype == "float32" else 1e-2), res["err"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(interpreted: dict, dtype: str) -> None:
    assert interpreted[f"rms_norm_{dtype}"]["alone_equal"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_batch_or_chunking(interpreted: dict, dtype: str) -> None:
    res = interpreted[f"attention_{dtype}"]
    assert res["alone_equal"], "a request alone differs from the same request in the batch"
    assert res["chunked_equal"], "a prefill cut into other chunks gives other bits"
    assert res["err"] < (1e-5 if dtype == "float32" else 1.5e-2), res["err"]


if __name__ == "__main__":
    main()
