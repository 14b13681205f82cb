"""KV between unlike grids: which part of which prefill process's blocks a decode process
needs (docs/design.md §3, "KV between unlike grids").

A grid of P pipeline stages × N tensor-parallel ranks splits a block's
``[layers, 2, tokens, kv_heads, head_dim]`` into P × N rectangles of (layers, KV heads):
process g = s·N + r holds stage s's layers of rank r's heads (with fewer KV heads than
ranks, a head is replicated on several ranks). A decode of another P or N owns other
rectangles; it takes each of its (layer, head) cells from one prefill process that holds
it. ``Reshard`` says, for one load, which process each side's rectangles belong to
(global layer and head indices, computed by the engine, which knows the model) and which
decode process this is; ``pieces`` intersects them. Every connector that can re-cut a
handoff uses it: the store loads (``kv_store/reshard_load.py``) read the prefill
processes' records, the p2p pulls pull their leases.

Only the split may differ: model, dtypes, block size and layout version are equal on both
sides (the decode checks the fingerprints' hash part before it accepts the handle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kv_store.base import KvLayout, rank_fingerprint


@dataclass(frozen=True, slots=True)
class Owned:
    """What one grid process's cache holds: global layers ``[layer_start, layer_end)`` and
    global KV heads ``[head_start, head_end)``, each stored from local index 0."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy ``source``'s local layers ``src_layers`` × heads ``src_heads`` into this
    process's local layers ``dst_layers`` × heads ``dst_heads`` (the same cells)."""

    source: int
    src_layers: slice
    dst_layers: slice
    src_heads: slice
    dst_heads: slice


@dataclass(slots=True)
class Reshard:
    """One load's re-cut: the prefill's fingerprint and grid (``sources``, global rank
    order), the decode's grid (``dests``) and which decode process runs it."""

    source_fingerprint: str
    sources: list[Owned]
    dests: list[Owned]
    dest_rank: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Reshard:
        return cls(
            str(d["source_fingerprint"]),
            [Owned(**o) for o in d["sources"]],
            [Owned(**o) for o in d["dests"]],
            int(d.get("dest_rank", 0)),
        )

    @property
    def mine(self) -> Owned:
        return self.dests[self.dest_rank]

    def pieces(self) -> list[Piece]:
        """What this process copies from which prefill process; together they cover its
        rectangle exactly once. A replicated head is taken from its first holder."""
        return _pieces(self.sources, self.mine)

    def pulls(self) -> list[tuple[int, int, bool]]:
        """p2p: ``(source, pullers, with_blocks)`` for each prefill process whose lease this
        process pulls. ``pullers``: how many decode processes pull that lease (each takes
        its part). A lease nobody needs (a replica) is ended by decode process 0 with a
        pull of no blocks, so it does not wait for its expiry."""
        users = [{p.source for p in _pieces(self.sources, d)} for d in self.dests]
        mine = users[self.dest_rank]
        out = [(s, sum(s in u for u in users), True) for s in sorted(mine)]
        if self.dest_rank == 0:
            used = set().union(*users)
            out += [(s, 1, False) for s in range(len(self.sources)) if s not in used]
        return out

    def source_ranks(self) -> list[int]:
        """The prefill processes this process reads from, in rank order."""
        return sorted({p.source for p in self.pieces()})

    def source_key_fingerprint(self, rank: int) -> str:
        """The fingerprint prefill process ``rank`` keys its records under."""
        return rank_fingerprint(self.source_fingerprint, rank, len(self.sources))

    def source_layout(self, rank: int, mine: KvLayout) -> KvLayout:
        """Prefill process ``rank``'s block layout: this process's, with its layers and heads."""
        src = self.sources[rank]
        return dataclasses.replace(mine, num_layers=src.num_layers, num_kv_heads=src.num_heads)


def _pieces(sources: list[Owned], mine: Owned) -> list[Piece]:
    out = []
    seen: set[tuple[int, int, int, int]] = set()
    for rank, src in enumerate(sources):
        cell = (src.layer_start, src.layer_end, src.head_start, src.head_end)
        if cell in seen:
            continue  # a replica of a rectangle an earlier process holds
        seen.add(cell)
        l0, l1 = max(src.layer_start, mine.layer_start), min(src.layer_end, mine.layer_end)
        h0, h1 = max(src.head_start, mine.head_start), min(src.head_end, mine.head_end)
        if l0 >= l1 or h0 >= h1:
            continue
        out.append(
            Piece(
                rank,
                slice(l0 - src.layer_start, l1 - src.layer_start),
                slice(l0 - mine.layer_start, l1 - mine.layer_start),
                slice(h0 - src.head_start, h1 - src.head_start),
                slice(h0 - mine.head_start, h1 - mine.head_start),
            )
        )
    return out


def covered(reshard: Reshard) -> bool:
    """Whether the pieces cover this process's whole rectangle (else the grids do not
    describe the same model: refuse rather than load a part)."""
    mine = reshard.mine
    cells = sum(
        (p.dst_layers.stop - p.dst_layers.start) * (p.dst_heads.stop - p.dst_heads.start)
        for p in reshard.pieces()
    )
    return cells == mine.num_layers * mine.num_heads
