"""Sliding-window and soft-capped attention in the Triton kernels (Triton's interpreter on
the CPU, in a child process: tests/triton_interpreter.py) against the torch_ref backend,
whose windowed/capped paths the model-level tests hold to transformers
(tests/integration/test_arch_parity.py). Cases cross window edges inside KV tiles and
blocks, mix decodes with chunked prefills, and force KV splits."""

from __future__ import annotations

import json

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import run_interpreted

# id: (q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, splits, window, softcap)
CASES: dict[str, tuple[list[int], list[int], int, int, int, int, str, int, int, float]] = {
    "decode_window7": ([1, 1, 1], [0, 20, 47], 4, 2, 16, 16, "float32", 0, 7, 0.0),
    "prefill_window16": ([50], [0], 4, 2, 16, 8, "float32", 0, 16, 0.0),
    "chunked_window13_g4": ([24, 1, 9], [40, 64, 3], 8, 2, 64, 16, "float32", 0, 13, 0.0),
    "mixed_window_bf16": ([9, 1, 23, 1], [0, 30, 16, 2], 8, 2, 64, 16, "bfloat16", 0, 11, 0.0),
    "decode_window_split3": ([1, 1], [300, 17], 8, 1, 64, 16, "float32", 3, 40, 0.0),
    "softcap_prefill": ([30, 1], [0, 25], 4, 2, 16, 16, "float32", 0, 0, 0.5),
    "softcap_window_chunked": ([17, 1], [33, 60], 4, 1, 32, 8, "float32", 0, 16, 0.7),
    "softcap_decode_split2": ([1, 1], [90, 5], 4, 2, 64, 16, "bfloat16", 2, 0, 1.0),
    "window_d96_chunked": ([20, 1], [30, 50], 4, 2, 96, 16, "float32", 0, 16, 0.0),
}
TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def _run_case(spec: tuple, seed: int) -> float:  # type: ignore[type-arg]
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_backend import LaunchConfig, paged_attention, write_kv_cache
    from engine.attention.triton_testing import make_case, relative_error

    q_lens, cached, heads, kv_heads, head_dim, block_size, dtype, splits, window, cap = spec
    case = make_case(
        q_lens, cached, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=getattr(torch, dtype), device="cpu", seed=seed,
    )  # fmt: skip
    cache32 = case.kv_cache.float().nan_to_num(0.0)
    write_kv_cache(case.key, case.value, case.kv_cache, case.meta.slot_mapping)
    config = None
    if splits:
        group = heads // kv_heads
        decode = case.meta.max_query_len == 1
        block_m = max(16, 1 << (group - 1).bit_length())
        config = LaunchConfig(
            block_q=1 if decode else max(1, block_m // group), block_m=block_m, block_n=16,
            num_splits=splits, decode_only=decode,
        )  # fmt: skip
    out = paged_attention(
        case.query, case.kv_cache, case.meta, case.scale, num_sms=None, config=config,
        window=window, softcap=cap,
    )  # fmt: skip
    ref = TorchRefAttention(cpu_kernels=False).forward(
        case.query.float(), case.key.float(), case.value.float(), cache32, case.meta,
        case.scale, window=window, softcap=cap,
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
def test_windowed_kernel_matches_torch_ref(interpreted: dict[str, float], name: str) -> None:
    err, tol = interpreted[name], TOL[CASES[name][6]]
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"


def test_window_changes_the_answer() -> None:
    """The cases' windows cut real context: without the window torch_ref differs (so the
    comparison above could fail)."""
    import torch

    from engine.attention.torch_ref import TorchRefAttention
    from engine.attention.triton_testing import make_case

    case = make_case(
        [1, 9], [40, 30], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
        dtype=torch.float32, device="cpu", seed=1,
    )  # fmt: skip
    cache = case.kv_cache.nan_to_num(0.0)
    args = (case.query, case.key, case.value, cache, case.meta, case.scale)
    full = TorchRefAttention(cpu_kernels=False).forward(*args)
    windowed = TorchRefAttention(cpu_kernels=False).forward(*args, window=8)
    assert not torch.allclose(full, windowed, atol=1e-3)


if __name__ == "__main__":
    main()
