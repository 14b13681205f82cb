"""Triton paged attention on the GPU against float64 attention and the torch_ref backend.

Every case draws its inputs from the fixed test seed (tests/seeds.py; printed on
failure). Skipped, with the reason, only where no CUDA GPU is present; the kernels' logic
also runs on the CPU in tests/unit/test_triton_interpret.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.seeds import fixed_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (q_lens, cached, heads, kv_heads, head_dim, block_size)
SHAPES = {
    "decode_b1_ctx512_8b": ([1], [511], 32, 8, 128, 16),
    "decode_b64_mixed_ctx": (
        [1] * 64,
        [random.Random(7).randrange(1, 3000) for _ in range(64)],
        32,
        8,
        128,
        16,
    ),
    "decode_long_32k_split": ([1], [32767], 32, 8, 128, 16),
    "decode_long_g1_d64": ([1, 1], [9000, 15], 16, 16, 64, 32),
    "prefill_2k_1b": ([2048], [0], 32, 8, 64, 16),
    "prefill_g3": ([300, 77], [0, 0], 12, 4, 128, 64),
    "chunked_prefill_prefix_hit": ([512, 256], [1024, 2048], 32, 8, 128, 16),
    "mixed_prefill_decode_g8": (
        [700] + [1] * 40,
        [33] + list(range(100, 4100, 100)),
        32,
        4,
        128,
        128,
    ),
    "mixed_g1_bs32": ([1, 129, 1, 64], [5000, 0, 17, 300], 8, 8, 64, 32),
    "prefix_partial_block": ([37, 1, 3], [48, 1, 61], 24, 8, 128, 16),
    "phi3_mini_d96": ([300, 1, 1], [0, 700, 4000], 32, 32, 96, 16),
}


def _check(name: str, spec: tuple, dtype: torch.dtype, seed: int) -> None:
    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import TritonAttention
    from engine.attention.triton_testing import (
        cache_error,
        make_case,
        reference_attention,
        relative_error,
    )

    q_lens, cached, heads, kv_heads, head_dim, block_size = spec
    case = make_case(
        q_lens,
        cached,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=seed,
    )
    # torch_ref reads whole blocks and masks afterwards, so NaN poison past a request's end
    # would leak into it (0 * NaN); in the engine those slots hold stale finite values.
    cache0 = case.kv_cache.nan_to_num(0.0)
    out = TritonAttention().forward(
        case.query, case.key, case.value, case.kv_cache, case.meta, case.scale
    )
    torch.cuda.synchronize()
    ref = reference_attention(case, device="cuda")
    err = relative_error(out, ref)
    assert cache_error(case) == 0.0, f"{name} seed={seed}: K/V written wrong"
    assert err < TOL[dtype], f"{name} {dtype} seed={seed}: rel err {err:.3e} vs float64"
    # The oracle backend on the same inputs (its own write into a fresh copy of the cache).
    oracle = TorchRefAttention().forward(
        case.query, case.key, case.value, cache0, case.meta, case.scale
    )
    err_ref = relative_error(out, oracle.double())
    assert err_ref < 2 * TOL[dtype], (
        f"{name} {dtype} seed={seed}: rel err {err_ref:.3e} vs torch_ref"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name: str, dtype: torch.dtype) -> None:
    _check(name, SHAPES[name], dtype, fixed_seed())


@pytest.mark.parametrize("trial", range(24))
def test_random_batches(trial: int) -> None:
    """Random mixes of decodes, fresh prefills and prefix hits over random model shapes."""
    seed = fixed_seed()
    rng = random.Random(seed)
    group = rng.choice([1, 3, 4, 8])
    kv_heads = rng.choice([1, 2, 4, 8])
    n = rng.randint(1, 24)
    q_lens, cached = [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:  # decode
            q_lens.append(1)
            cached.append(rng.randint(0, 6000))
        elif kind < 0.75:  # fresh prefill
            q_lens.append(rng.randint(2, 700))
            cached.append(0)
        else:  # prefix hit / later chunk
            q_lens.append(rng.randint(1, 400))
            cached.append(rng.randint(1, 3000))
    spec = (
        q_lens,
        cached,
        group * kv_heads,
        kv_heads,
        rng.choice([64, 128]),
        rng.choice([16, 32, 64, 128]),
    )
    _check(f"random{trial}", spec, rng.choice([torch.bfloat16, torch.float32]), seed)


def test_forced_split_counts_agree() -> None:
    """Every split count gives the same answer as no split (within bf16 rounding)."""
    from engine.attention.triton_backend import LaunchConfig, paged_attention, write_kv_cache
    from engine.attention.triton_testing import make_case, reference_attention, relative_error

    seed = fixed_seed()
    case = make_case(
        [1] * 5,
        [10, 100, 1000, 5000, 20000],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed,
    )
    write_kv_cache(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    ref = reference_attention(case, device="cuda")
    for splits in (1, 2, 3, 8, 17, 64):
        cfg = LaunchConfig(block_q=1, block_m=16, block_n=64, num_splits=splits, decode_only=True)
        out = paged_attention(
            case.query, case.kv_cache, case.meta, case.scale, num_sms=132, config=cfg
        )
        err = relative_error(out, ref)
        assert err < TOL[torch.bfloat16], f"splits={splits} seed={seed}: rel err {err:.3e}"


def test_decode_step_captures_in_a_cuda_graph() -> None:
    """The backend never syncs with the host: a decode step replays from a graph with new data."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.triton_backend import TritonAttention
    from engine.attention.triton_testing import make_case, reference_attention, relative_error

    seed = fixed_seed()
    backend = TritonAttention()
    lens = [300, 17, 2000, 64]
    case = make_case(
        [1] * 4,
        lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed,
        num_blocks=400,
    )
    q, k, v = case.query.clone(), case.key.clone(), case.value.clone()
    meta = case.meta
    static = AttentionMetadata(
        slot_mapping=meta.slot_mapping.clone(),
        query_start_loc=meta.query_start_loc.clone(),
        seq_lens=meta.seq_lens.clone(),
        block_tables=meta.block_tables.clone(),
        max_query_len=1,
        max_seq_len=4096,
        query_start_loc_cpu=meta.query_start_loc_cpu,
        seq_lens_cpu=[4096] * 4,
    )
    backend.forward(q, k, v, case.kv_cache, static, case.scale)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, case.kv_cache, static, case.scale)
    # A second problem of the same batch size, copied into the static inputs.
    case2 = make_case(
        [1] * 4,
        [5, 999, 40, 1900],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed + 1,
        num_blocks=400,
    )
    case.kv_cache.copy_(case2.kv_cache)
    for dst, src in ((q, case2.query), (k, case2.key), (v, case2.value)):
        dst.copy_(src)
    static.slot_mapping.copy_(case2.meta.slot_mapping)
    static.seq_lens.copy_(case2.meta.seq_lens)
    static.block_tables[:, : case2.meta.block_tables.shape[1]].copy_(case2.meta.block_tables)
    graph.replay()
    torch.cuda.synchronize()
    err = relative_error(out, reference_attention(case2, device="cuda"))
    assert err < TOL[torch.bfloat16], f"graph replay seed={seed}: rel err {err:.3e}"
