"""A nixl load of blocks another grid split (docs/design.md §3, "KV between unlike grids").

The handle of a prefill grid of P x N processes lists each process's card and lease
(``,``-joined, global rank order). This decode process reads, from each prefill process
it needs (``Reshard.pulls``), the cells it owns (``Reshard.pieces``: one rectangle of
layers x KV heads per source), each as an ordinary pin → READ → ``done`` under that
process's own fingerprint and layout, so the holder's checks apply unchanged. A lease that
several decode processes need is pinned by each (``pullers``) and ends after the last
``done``; one nobody needs (a replica) is released by decode process 0 with a pin of no
blocks.

Where a source holds exactly this process's heads (only the layers differ: pipeline
stages), the READ lands straight in the pool, in the piece's layers of the engine's
blocks. Otherwise the heads of one token are not contiguous on both sides: the READ lands
in a scratch buffer shaped like the source's blocks (registered for the load, released
after it) and the piece's heads are copied into the pool once every source has delivered.
The load succeeds only whole: every source's READ, then the copies.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kv_store.base import KvLayout, TransferResult, byte_view
from kv_store.nixl.agent import PoolAgent, Scratch, Span, layout_dict
from kv_store.nixl.card import Card, CardError, parse_transfer_id
from kv_store.nixl.puller import Pull, Puller
from kv_store.reshard import Piece, Reshard
from kv_store.tp_connector import split_ranks

logger = logging.getLogger(__name__)


def _rows(layers: slice, planes: int) -> list[int]:
    """The region rows (layer x plane, layer-major) of ``layers``."""
    return list(range(layers.start * planes, layers.stop * planes))


@dataclass(slots=True)
class _Copy:
    """A piece read into scratch: copied into the pool once every source delivered."""

    piece: Piece
    scratch: Scratch


@dataclass(slots=True)
class Recut:
    """One re-cut load (``pull.transfer.reshard`` set); ``start`` runs it on the progress
    thread, ``on_result`` gets its one result."""

    pull: Pull
    agent: PoolAgent
    puller: Puller
    kv: torch.Tensor
    layout: KvLayout
    on_result: Callable[[TransferResult], None]
    parts: list[Pull] = field(default_factory=list)
    copies: list[_Copy] = field(default_factory=list)
    results: list[TransferResult] = field(default_factory=list)

    def start(self) -> None:
        self.pull.t0 = time.perf_counter()
        try:
            self._plan()
        except CardError as e:
            self._release()
            self._report(self._failed(e.reason, str(e)))
            return
        for part in list(self.parts):  # a part may fail at once: its result comes first
            self.puller.begin(part)

    def _plan(self) -> None:
        t = self.pull.transfer
        assert t.reshard is not None
        r = Reshard.from_json(t.reshard)
        size = len(r.sources)
        cards = split_ranks(t.source_address, size)
        leases = split_ranks(t.transfer_id, size)
        if cards is None or leases is None:
            raise CardError(
                f"the KV handle does not list the prefill grid's {size} sources", "layout"
            )
        pieces = {p.source: p for p in r.pieces()}
        n = len(t.block_ids) - t.start_block
        for source, pullers, with_blocks in r.pulls():
            card = Card.decode(cards[source])
            lease_id, ids = parse_transfer_id(leases[source])
            src_layout = r.source_layout(source, self.layout)
            part = replace(
                self.pull,
                card=card,
                lease_id=lease_id,
                expect=(r.source_key_fingerprint(source), layout_dict(src_layout)),
                pullers=pullers,
                sink=self._collect,
            )
            if not with_blocks or n == 0:  # end the hold, read nothing
                part.src_ids, part.start, part.dst = [], len(ids), self.agent.pool_span([])
            else:
                if len(ids) != len(t.block_ids) or max(ids) >= card.num_blocks:
                    raise CardError(f"prefill process {source}: descriptors do not fit")
                part.src_ids, part.start = ids[t.start_block :], t.start_block
                self._target(part, pieces[source], src_layout, card)
            self.parts.append(part)

    def _target(self, part: Pull, piece: Piece, src: KvLayout, card: Card) -> None:
        """Where ``part``'s READ lands: the pool itself when the source holds exactly this
        process's heads, else a scratch buffer of the source's block shape."""
        t, mine, planes = part.transfer, self.layout, self.layout.planes
        assert part.src_ids is not None
        n = len(part.src_ids)
        part.src_regions = _rows(piece.src_layers, planes)
        layers = piece.src_layers.stop - piece.src_layers.start
        whole_src = (piece.src_heads.start, piece.src_heads.stop) == (0, src.num_kv_heads)
        whole_dst = (piece.dst_heads.start, piece.dst_heads.stop) == (0, mine.num_kv_heads)
        if whole_src and whole_dst:
            if card.region_bytes != self.agent.region_bytes:
                raise CardError("the prefill's block regions differ from this pool's", "layout")
            rows = _rows(piece.dst_layers, planes)
            part.dst = self.agent.pool_span(t.block_ids[t.start_block :], rows)
        else:
            shape = (layers, planes, n, src.block_size, src.num_kv_heads, src.head_dim)
            scratch = self.agent.scratch(shape, self.kv)
            self.copies.append(_Copy(piece, scratch))
            if scratch.tensor[0, 0, 0].numel() * scratch.tensor.element_size() != card.region_bytes:
                raise CardError("the prefill's block regions differ from its layout", "layout")
            part.dst = Span(scratch.dlist, n, layers * planes, list(range(n)))
        part.nbytes = len(part.src_regions) * card.region_bytes * n

    def _collect(self, result: TransferResult) -> None:
        self.results.append(result)
        if len(self.results) < len(self.parts):
            return
        failed = next((r for r in self.results if not r.ok), None)
        if failed is None:
            try:
                self._copy()
            except Exception as e:  # noqa: BLE001 - a bug is a failed load, never a lost one
                logger.exception("nixl re-cut copy of %s failed", self.pull.transfer.request_id)
                failed = self._failed("error", repr(e))
        self._release()
        if failed is not None:
            res = self._failed(failed.failure_reason or "error", failed.error or "")
        else:
            t = self.pull.transfer
            n = len(t.block_ids) - t.start_block
            res = TransferResult(t.request_id, "load", True, num_loaded_blocks=n)
            res.bytes_moved = sum(r.bytes_moved for r in self.results)
            res.seconds = time.perf_counter() - self.pull.t0
        self._report(res)

    def _copy(self) -> None:
        """The scratch pieces' heads into the engine's blocks (after every READ)."""
        if not self.copies:
            return
        t = self.pull.transfer
        dst = byte_view(self.kv)
        # Its own stream on the GPU (not the engine's): everything below is ordered on it.
        stream = torch.cuda.Stream(self.kv.device) if self.kv.is_cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ids = torch.tensor(t.block_ids[t.start_block :], device=self.kv.device)
            for c in self.copies:
                p = c.piece
                src = byte_view(c.scratch.tensor)[:, :, :, :, p.src_heads]
                dst[p.dst_layers, :, ids, :, p.dst_heads] = src
        if stream is not None:
            stream.synchronize()

    def _release(self) -> None:
        for c in self.copies:
            self.agent.release_scratch(c.scratch)
        self.copies.clear()

    def _failed(self, reason: str, error: str) -> TransferResult:
        res = TransferResult(self.pull.transfer.request_id, "load", False, failure_reason=reason)
        res.error = error
        return res

    def _report(self, res: TransferResult) -> None:
        if not res.ok:
            logger.warning(
                "nixl re-cut load of %s failed (%s): %s",
                res.request_id,
                res.failure_reason,
                res.error,
            )
        self.on_result(res)
