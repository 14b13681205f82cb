"""A p2p load of blocks another grid split (docs/design.md §3, "KV between unlike grids"):
this decode process pulls, from each prefill process it needs (``Reshard.pulls``), that
process's shard of the blocks into a scratch tensor shaped like the prefill's cache, then
copies its own part of each (``Reshard.pieces``) into its cache.

Each pull is an ordinary pull (``PeerLink``) under the prefill process's own fingerprint
and layout, so the source's checks apply unchanged; a lease that several decode processes
need is pulled by each of them (``pullers``) and ends when the last has. The links are made
for the load and closed after it: a re-cut costs a pair rendezvous per source (about 0.15 s
on gloo), which a handoff between like grids pays only once per pair of instances. A block
counts as loaded when every source delivered it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import torch

from kv_store.base import KvLayout, KVTransfer, TransferResult, byte_view, layout_wire_dict
from kv_store.p2p.client import LinkConfig, PeerLink, PullJob
from kv_store.reshard import Reshard
from kv_store.tp_connector import split_ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from kv_store.p2p.stats import P2PCounters

logger = logging.getLogger(__name__)


class ReshardPull:
    """One re-cut load, run on its own thread; ``on_result`` gets its one result."""

    def __init__(
        self,
        transfer: KVTransfer,
        kv: torch.Tensor,
        layout: KvLayout,
        config: LinkConfig,
        counters: P2PCounters,
        on_result: Callable[[TransferResult], None],
        timeout_s: float,
    ) -> None:
        assert transfer.reshard is not None
        self.t, self.kv, self.layout = transfer, kv, layout
        self.config, self.counters, self.on_result = config, counters, on_result
        self.timeout_s = timeout_s
        self.reshard = Reshard.from_json(transfer.reshard)
        self._results: queue.SimpleQueue[tuple[int, TransferResult]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kv-p2p-recut", daemon=True).start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            result = self._pull_all()
        except Exception as e:  # a bug must surface as a failed load, never a lost one
            logger.exception("p2p re-cut load of %s failed", self.t.request_id)
            result = TransferResult(self.t.request_id, "load", False, failure_reason="error")
            result.error = repr(e)
        result.seconds = time.perf_counter() - t0
        self.on_result(result)

    def _pull_all(self) -> TransferResult:
        t, r = self.t, self.reshard
        size = len(r.sources)
        addresses = split_ranks(t.source_address, size)
        ids = split_ranks(t.transfer_id, size)
        if addresses is None or ids is None:
            res = TransferResult(t.request_id, "load", False, failure_reason="layout")
            res.error = f"the KV handle does not list the prefill grid's {size} p2p sources"
            return res
        n = len(t.block_hashes) - t.start_block
        deadline = time.monotonic() + self.timeout_s
        scratch: dict[int, torch.Tensor] = {}
        links: list[PeerLink] = []
        try:
            for source, pullers, with_blocks in r.pulls():
                job_t = self._job_transfer(with_blocks)
                if with_blocks:
                    scratch[source] = self._scratch(r.source_layout(source, self.layout), n)
                link = self._link(source, addresses[source], scratch.get(source))
                links.append(link)
                job = PullJob(job_t, ids[source], deadline, None, pullers)
                link.submit(job)
            parts = self._collect(len(links), deadline + 1.0)
        finally:
            for link in links:
                link.close()
        return self._combine(parts, scratch, n)

    def _job_transfer(self, with_blocks: bool) -> KVTransfer:
        """The pull's transfer: its blocks land in scratch slots 0.. (none for a release)."""
        t = self.t
        if not with_blocks:
            return KVTransfer(f"{t.request_id}#release", [], [], [], [])
        n = len(t.block_hashes) - t.start_block
        return KVTransfer(
            t.request_id,
            t.token_ids,
            t.block_hashes,
            [0] * t.start_block + list(range(n)),
            t.block_num_tokens,
            t.start_block,
        )

    def _scratch(self, layout: KvLayout, n: int) -> torch.Tensor:
        shape = (
            layout.num_layers, layout.planes, max(1, n), layout.block_size, layout.num_kv_heads,
            layout.head_dim,
        )  # fmt: skip
        return torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)

    def _link(self, source: int, address: str, scratch: torch.Tensor | None) -> PeerLink:
        """A link that presents prefill process ``source``'s own fingerprint and layout."""
        layout = self.reshard.source_layout(source, self.layout)
        hello = dict(self.config.hello)
        hello["layout"] = layout_wire_dict(layout)
        hello["fingerprint"] = self.reshard.source_key_fingerprint(source)
        kv = scratch if scratch is not None else self._scratch(layout, 1)
        config = dataclasses.replace(self.config, kv=kv, hello=hello)

        def done(result: TransferResult) -> None:
            self._results.put((source, result))

        return PeerLink(address, config, self.counters, done, lambda _link: None)

    def _collect(self, count: int, deadline: float) -> dict[int, TransferResult]:
        parts: dict[int, TransferResult] = {}
        while len(parts) < count:
            try:
                source, result = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            parts[source] = result
        return parts

    def _combine(
        self, parts: dict[int, TransferResult], scratch: dict[int, torch.Tensor], n: int
    ) -> TransferResult:
        t = self.t
        res = TransferResult(t.request_id, "load", True)
        missing = [s for s in scratch if s not in parts]
        failed = [(s, p) for s, p in parts.items() if s in scratch and not p.ok]
        loaded = min((parts[s].num_loaded_blocks for s in scratch if s in parts), default=n)
        if missing:
            loaded, res.ok, res.failure_reason = 0, False, "timeout"
            res.error = f"no answer from prefill processes {missing} within the deadline"
        elif failed:
            res.ok, res.failure_reason = False, failed[0][1].failure_reason
            res.error = f"prefill process {failed[0][0]}: {failed[0][1].error}"
        res.num_loaded_blocks = loaded
        res.bytes_moved = sum(p.bytes_moved for p in parts.values())
        if self.kv.device.type == "cuda":  # the pulls' copies ran on their own streams
            torch.cuda.synchronize(self.kv.device)
        dst = byte_view(self.kv)
        for j in range(loaded):
            i = t.start_block + j
            block, tokens = t.block_ids[i], t.block_num_tokens[i]
            for p in self.reshard.pieces():
                src = byte_view(scratch[p.source])[p.src_layers, :, j, :tokens, p.src_heads]
                dst[p.dst_layers, :, block, :tokens, p.dst_heads].copy_(src)
        return res
