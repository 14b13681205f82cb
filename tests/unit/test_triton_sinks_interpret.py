"""Attention sinks (gpt-oss) in the Triton kernel (Triton's interpreter on the CPU, in a
child process: tests/triton_interpreter.py) against the torch_ref backend, whose sink path
the model-level test holds to transformers (tests/integration/test_gpt_oss.py). Cases
mix decodes with chunked prefills, windows, and KV splits (only split 0 may count the
sink); the sinks are large enough to take a real share of each row's softmax."""

from __future__ import annotations

import json

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# id: (q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, splits, window)
CASES: dict[str, tuple[list[int], list[int], int, int, int, int, str, int, int]] = {
    "decode": ([1, 1, 1], [0, 20, 47], 4, 2, 16, 16, "float32", 0, 0),
    "prefill": ([40], [0], 4, 2, 16, 8, "float32", 0, 0),
    "chunked_window_g4": ([24, 1, 9], [40, 64, 3], 8, 2, 64, 16, "float32", 0, 13),
    "decode_split3": ([1, 1], [300, 17], 8, 1, 64, 16, "float32", 3, 0),
    "decode_window_split2": ([1, 1], [200, 9], 4, 2, 64, 16, "float32", 2, 40),
    "mixed_bf16": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "bfloat16", 0, 11),
}
TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def _sinks(heads: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0


def _run_case(spec: tuple, seed: int) -> float:  # type: ignore[type-arg]
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import LaunchConfig, paged_attention, write_kv_cache
    from engine.attention.triton_testing import make_case, relative_error

    q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, splits, window = spec
    case = make_case(
        q_lens, cached, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=getattr(torch, dtype), device="cpu", seed=seed,
    )  # fmt: skip
    sinks = _sinks(heads, seed)
    cache32 = case.kv_cache.float().nan_to_num(0.0)
    write_kv_cache(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    config = None
    if splits:
        group = heads // kv_heads
        block_m = max(16, 1 << (group - 1).bit_length())
        config = LaunchConfig(
            block_q=1, block_m=block_m, block_n=16, num_splits=splits, decode_only=True
        )
    out = paged_attention(
        case.query, case.kv_cache, case.meta, case.scale, num_sms=None, config=config,
        window=window, sinks=sinks.to(case.query.dtype),
    )  # fmt: skip
    ref = TorchRefAttention(cpu_kernels=False).forward(
        case.query.float(), case.key.float(), case.value.float(), cache32, case.meta,
        case.scale, window=window, sinks=sinks.to(case.query.dtype).float(),
    )  # fmt: skip
    return relative_error(out.float(), ref.double())


def main() -> None:
    import torch

    torch.set_num_threads(1)
    seed = fixed_seed()
    results = {name: _run_case(spec, seed + i) for i, (name, spec) in enumerate(CASES.items())}
    print(json.dumps({"seed": seed, "results": results}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    payload, _ = run_interpreted(__file__)
    print(f"seed {payload['seed']}")
    results: dict[str, float] = payload["results"]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_sink_kernel_matches_torch_ref(interpreted: dict[str, float], name: str) -> None:
    err, tol = interpreted[name], TOL[CASES[name][6]]
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"


def test_torch_ref_sinks_are_an_extra_softmax_column() -> None:
    """torch_ref's sinks, against the definition written out for one decode row and one
    prefill: softmax over [scores, sink] with the sink's column dropped, decode rows
    (the padded batch) and prefill rows (per request) alike; and they change the answer."""
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_testing import make_case

    case = make_case(
        [1, 6], [30, 0], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
        dtype=torch.float32, device="cpu", seed=3,
    )  # fmt: skip
    sinks = _sinks(4, 3)
    cache = case.kv_cache.nan_to_num(0.0)
    args = (case.query, case.key, case.value, cache, case.meta, case.scale)
    got = TorchRefAttention(cpu_kernels=False).forward(*args, sinks=sinks)
    plain = TorchRefAttention(cpu_kernels=False).forward(*args)
    assert not torch.allclose(got, plain, atol=1e-3)
    starts = case.meta.query_start_loc_cpu
    for r in range(2):
        k, v = case.full_k[r].float(), case.full_v[r].float()
        q = case.query[starts[r] : starts[r + 1]].float()
        seq = k.shape[0]
        for j in range(q.shape[0]):
            pos = seq - q.shape[0] + j
            for h in range(4):
                kv = h // 2
                s = (k[: pos + 1, kv] @ q[j, h]) * case.scale
                p = torch.softmax(torch.cat((s, sinks[h : h + 1])), 0)[:-1]
                want = p @ v[: pos + 1, kv]
                assert torch.allclose(got[starts[r] + j, h], want, atol=1e-5)


if __name__ == "__main__":
    main()
