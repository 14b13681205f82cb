"""The step's LoRA work list for the Triton kernels (engine/lora/triton_lora.py), built on
the host from the token -> slot index the scheduler already holds.

The adapter tokens are sorted by slot (stable, so each run keeps the runner's token
order) into ``order``, and each slot's run is cut into blocks of at most ``BLOCK_M``
tokens: one row ``(slot, start in order, count)`` per block. A kernel program takes one
block, so it loads its slot's A and B tiles once for up to ``BLOCK_M`` tokens and
multiplies them on the tensor cores. Base-model tokens (slot -1) are in no block.

A step of ``T`` tokens over ``S`` slots has at most ``cdiv(T, BLOCK_M) + min(S, T)``
blocks (each slot adds at most one partial block): the kernels' grid depends on ``T``
and ``S`` only, never on the mix, so one CUDA graph per token count replays any mix.
Rows past the step's blocks hold ``count = 0`` and their programs exit at once.
"""

from __future__ import annotations

import numpy as np

BLOCK_M = 16  # tokens per program: tl.dot's smallest M


def max_blocks(tokens: int, num_slots: int) -> int:
    """Rows of the work list a step of ``tokens`` tokens over ``num_slots`` slots needs."""
    return -(-tokens // BLOCK_M) + min(num_slots, tokens)


def plan_blocks(token_slots: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(table, order)``: ``table`` int32 ``[rows, 3]`` of ``(slot, start, count)``
    (unused rows zero), ``order`` int32: the adapter tokens' indices sorted by slot."""
    slots = np.asarray(token_slots, dtype=np.int32)
    idx = np.flatnonzero(slots >= 0)
    order = idx[np.argsort(slots[idx], kind="stable")].astype(np.int32)
    table = np.zeros((rows, 3), dtype=np.int32)
    if not len(order):
        return table, order
    sorted_slots = slots[order]
    bounds = [0, *(np.flatnonzero(np.diff(sorted_slots)) + 1).tolist(), len(order)]
    row = 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=False):
        for start in range(lo, hi, BLOCK_M):
            if row >= rows:
                raise ValueError(f"{rows} work-list rows are too few for this step")
            table[row] = (sorted_slots[lo], start, min(BLOCK_M, hi - start))
            row += 1
    return table, order
