"""How the Triton paged attention is launched: the tile sizes and KV splits per step shape
(``choose_config``) and the fixed ones of deterministic mode (``invariant_config``). Split
from ``triton_backend.py``, which launches the kernels with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile shape of one attention launch (see the kernel docstring for the terms)."""

    block_q: int
    block_m: int
    block_n: int
    num_splits: int
    decode_only: bool
    num_warps: int = 4
    num_stages: int = 2


def pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (Triton block shapes)."""
    return 1 << max(0, (x - 1).bit_length())


def choose_config(
    *,
    max_query_len: int,
    max_seq_len: int,
    num_reqs: int,
    num_tokens: int,
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
    num_sms: int | None,
) -> LaunchConfig:
    """Pick tiles. ``num_sms`` None means the interpreter: small tiles, many loop trips.

    GPU choices come from the H200 tile sweep in benchmarks/results/gpu/gpu_h200.json.
    """
    wide = dtype != torch.float32  # fp32 tiles take twice the shared memory
    if max_query_len <= 1:
        splits = 1
        if num_sms is not None:
            # Enough programs for ~2 waves, but no split shorter than ~256 tokens.
            want = math.ceil(2 * num_sms / max(1, num_reqs * num_kv_heads))
            splits = max(1, min(want, math.ceil(max_seq_len / 256), 32))
        return LaunchConfig(
            block_q=1,
            block_m=max(16, pow2(group)),
            block_n=(128 if wide else 64) if num_sms is not None else 16,
            num_splits=splits,
            decode_only=True,
            num_warps=4,
            num_stages=2,
        )
    if num_sms is None:
        block_m, block_n = 16, 16
    elif wide:
        block_m, block_n = (128 if num_tokens >= 4096 else 64), 64
    else:
        block_m, block_n = 64, 32
    return _prefill_tiles(block_m, block_n, group)


def _prefill_tiles(block_m: int, block_n: int, group: int) -> LaunchConfig:
    """A one-pass (no KV split) launch of ``block_m`` query rows, widened to hold a whole
    query-head group, as ``block_q`` tokens of ``group`` heads each."""
    block_m = max(block_m, pow2(group))
    return LaunchConfig(
        block_q=max(1, block_m // group),
        block_m=block_m,
        block_n=block_n,
        num_splits=1,
        decode_only=False,
    )


def invariant_config(group: int, dtype: torch.dtype, num_sms: int | None) -> LaunchConfig:
    """Deterministic mode (docs/design.md §3): one tile shape for every step, whatever its
    batch. No KV split (``choose_config`` splits by the number of requests), the same
    ``BLOCK_N`` for decodes and prefills (a decode row gives the bits it would give inside
    a mixed step), and KV tiles at fixed absolute positions from 0, so neither the rows
    beside a query nor where its prompt was cut into chunks change the order it sums in."""
    if num_sms is None:
        block_m, block_n = 16, 16
    else:
        block_m, block_n = 64, (64 if dtype != torch.float32 else 32)
    return _prefill_tiles(block_m, block_n, group)
