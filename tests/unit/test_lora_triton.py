"""The Triton LoRA kernels (engine/lora/triton_lora.py) against the torch path
(engine/lora/slots.py ``lora_torch``) and a float64 reference, on the CPU through Triton's
interpreter; tests/gpu/test_lora_gpu.py runs the same cases and 8B shapes on a GPU.

Each case draws a batch whose tokens mix several slots and base-model tokens (slot -1),
over a merged projection of 1-3 sub-modules, with adapters of ranks at and below the
slot rank (the rows past an adapter's rank are zero, as ``LoRASlots.load`` leaves them).
Bound per element: ``|y - ref| <= tol * (|x| |A|^T |B|^T + |base|)`` in float64, with tol
2^-18 for float32 and 2^-6 for bf16 (two roundings to bf16: the projection output it adds
to and the sum); base-model rows must come back bit for bit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.seeds import fixed_seed
from tests.triton_interpreter import interpreted_results

# name: (tokens, in, sub-module output sizes, slot rank, slots, dtype, shrink programs)
# The shrink's K is split until blocks x chunks reach "shrink programs" (engine/lora/
# triton_lora.py): 1 keeps it whole, more splits it (atomic sums). Sizes past 128 columns
# make several column tiles per sub-module; more than 16 tokens of a slot, several blocks.
SMALL_CASES: dict[str, tuple[int, int, list[int], int, int, str, int]] = {
    "qkv_f32_mixed": (7, 64, [64, 32, 32], 8, 3, "float32", 1),
    "o_f32_ragged": (5, 70, [33], 4, 2, "float32", 1),
    "gate_up_f32_rank16": (4, 130, [48, 48], 16, 2, "float32", 64),
    "down_bf16": (6, 96, [64], 8, 4, "bfloat16", 1),
    "qkv_bf16_one_token": (1, 64, [64, 16, 16], 8, 2, "bfloat16", 1),
    "qkv_f32_blocks_split_k": (45, 300, [136, 40, 40], 8, 3, "float32", 64),
    "gate_up_bf16_tiles": (20, 64, [200, 200], 4, 2, "bfloat16", 8),
}
TOL = {"float32": 2.0**-18, "bfloat16": 2.0**-6}


def lora_case(
    t: int, fan_in: int, sizes: list[int], rank: int, n_slots: int, dtype_name: str,
    programs: int, device: str, seed: int,
) -> dict[str, float]:  # fmt: skip
    """Largest error / bound of the Triton and the torch path, and whether base rows
    were left untouched (0.0) or not (inf)."""
    import torch

    from engine.lora.plan import max_blocks, plan_blocks
    from engine.lora.slots import lora_torch
    from engine.lora.triton_lora import lora_shrink_expand

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    subs, n = len(sizes), sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(subs)]
    a = torch.zeros(n_slots, subs * rank, fan_in)
    b = torch.zeros(n_slots, n, rank)
    for s in range(n_slots):
        r = max(1, rank >> (s % 3))  # ranks at and below the slot rank
        for i, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            a[s, i * rank : i * rank + r] = torch.randn(r, fan_in, generator=gen) / fan_in**0.5
            b[s, off : off + size, :r] = torch.randn(size, r, generator=gen)
    x = torch.randn(t, fan_in, generator=gen)
    base = torch.randn(t, n, generator=gen)
    slots = torch.randint(-1, n_slots, (t,), generator=gen, dtype=torch.int32)
    slots[0] = 0  # at least one adapter token
    if t > 2:
        slots[1] = -1  # and one base-model token
    x, base, a, b = (v.to(dtype).to(device) for v in (x, base, a, b))
    slots = slots.to(device)
    ref = base.double().clone()
    mag = base.double().abs()
    for i in range(t):
        s = int(slots[i])
        if s < 0:
            continue
        shr = x[i].double() @ a[s].double().T
        shr_mag = x[i].double().abs() @ a[s].double().abs().T
        for j, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            seg = slice(j * rank, (j + 1) * rank)
            ref[i, off : off + size] += b[s, off : off + size].double() @ shr[seg]
            mag[i, off : off + size] += b[s, off : off + size].double().abs() @ shr_mag[seg]
    bound = TOL[dtype_name] * mag + 1e-30
    out: dict[str, float] = {}
    triton_out = base.clone()
    # Two spare work-list rows (zero), as a graph bucket larger than the step has.
    table, order = plan_blocks(slots.cpu().numpy(), max_blocks(t, n_slots) + 2)
    y = torch.zeros(t, subs * rank, dtype=torch.float32, device=device)
    lora_shrink_expand(
        x, triton_out, a, b, y, torch.from_numpy(table).to(device),
        torch.from_numpy(order).to(device), offsets, sizes, rank, programs,
    )  # fmt: skip
    present = sorted({int(s) for s in slots.tolist() if s >= 0})
    torch_out = base.clone()
    lora_torch(x, torch_out, a, b, slots, present, offsets, sizes, rank)
    out["triton"] = float(((triton_out.double() - ref).abs() / bound).max())
    out["torch"] = float(((torch_out.double() - ref).abs() / bound).max())
    keep = slots < 0
    same = torch.equal(triton_out[keep], base[keep]) and torch.equal(torch_out[keep], base[keep])
    out["base_rows"] = 0.0 if same else float("inf")
    return out


def run_cases(cases: dict[str, Any], device: str) -> dict[str, float]:
    seed = fixed_seed()
    print(f"seed {seed}", file=sys.stderr)
    out = {}
    for i, (name, spec) in enumerate(cases.items()):
        for part, value in lora_case(*spec, device, seed + i).items():
            out[f"{name}/{part}"] = value
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return interpreted_results(__file__)


@pytest.mark.parametrize(
    "name", [f"{c}/{p}" for c in SMALL_CASES for p in ("triton", "torch", "base_rows")]
)
def test_lora_kernels_under_interpreter(results: dict[str, float], name: str) -> None:
    assert results[name] <= 1.0, f"{name}: error {results[name]:.3g} x the bound"


if __name__ == "__main__":
    print(json.dumps(run_cases(SMALL_CASES, "cpu")))


def test_work_list_groups_tokens_by_slot_in_blocks() -> None:
    """plan_blocks: each slot's tokens in runner order, cut into blocks of at most 16;
    base-model tokens in none; spare rows zero; too few rows is an error."""
    import numpy as np

    from engine.lora.plan import BLOCK_M, max_blocks, plan_blocks

    slots = np.array([2, -1, 0] + [2] * 20 + [-1, 0], dtype=np.int32)
    rows = max_blocks(len(slots), 3)
    table, order = plan_blocks(slots, rows)
    twos = [0, *range(3, 23)]
    assert order.tolist() == [2, 24, *twos]
    live = table[table[:, 2] > 0].tolist()
    assert live == [[0, 0, 2], [2, 2, BLOCK_M], [2, 2 + BLOCK_M, 5]]
    assert (table[len(live) :] == 0).all() and len(table) == rows
    empty, none = plan_blocks(np.full(5, -1, dtype=np.int32), 3)
    assert not len(none) and not empty.any()
    with pytest.raises(ValueError, match="too few"):
        plan_blocks(slots, 2)
