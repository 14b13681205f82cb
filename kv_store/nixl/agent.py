"""``PoolAgent``: one engine's NIXL agent with its paged KV pool registered once.

The cache ``[layers, 2, blocks, block, heads, dim]`` is contiguous, so it is
``regions = layers * 2`` runs of ``num_blocks`` equal chunks: block ``b`` of region ``r``
lies at ``base + (r * num_blocks + b) * region_bytes``. Every chunk of the pool is one
descriptor, prepared once (locally at bind, per peer when its card is first seen); a
request's READ then names descriptor indices only.

Not thread-safe: the connector's progress thread makes every call (the agent runs without
NIXL's own locking; its progress thread drives UCX).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kv_store.base import KvLayout, byte_view, layout_wire_dict
from kv_store.nixl.card import Card

logger = logging.getLogger(__name__)

# Tried in order: the CUDA 13 wheel (the GPU machine's torch), the CUDA 12 one, then the
# `nixl` meta package (which picks one of those by the CUDA it finds).
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl._api")
INSTALL_HINT = (
    "--connector nixl needs NIXL: pip install --no-deps 'nixl-cu13==1.5.1' (its wheel "
    "declares torch; --no-deps keeps the installed one), or the project's nixl extra "
    "(docs/kv-store.md)"
)


def load_nixl() -> Any:
    """The NIXL Python module; ``RuntimeError`` saying how to install it when absent."""
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        _route_logs()
        return mod
    raise RuntimeError(INSTALL_HINT)


def _route_logs() -> None:
    """NIXL's Python logger writes INFO lines to stdout; a service's stdout is not a log
    (tools read it), so they go to stderr, from WARNING (``NIXL_LOG_LEVEL`` still rules)."""
    nixl_log = logging.getLogger("nixl")
    for handler in nixl_log.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


def nixl_available() -> bool:
    try:
        load_nixl()
    except RuntimeError:
        return False
    return True


def _descs(base: int, count: int, size: int, device: int) -> np.ndarray:
    """``count`` descriptors ``(address, size, device)`` of consecutive ``size``-byte chunks."""
    out = np.empty((count, 3), dtype=np.int64)
    out[:, 0] = base + np.arange(count, dtype=np.int64) * size
    out[:, 1] = size
    out[:, 2] = device
    return out


def layout_dict(layout: KvLayout) -> dict[str, Any]:
    """The KV layout as a card and a pin carry it (``kv_store.base.layout_wire_dict``)."""
    return layout_wire_dict(layout)


def block_indices(block_ids: list[int], regions: Any, num_blocks: int) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in ``regions`` (a count: all of them, or the
    region numbers): region-major, so both sides' lists line up."""
    ids = np.asarray(block_ids, dtype=np.int64)
    rows = np.arange(regions) if isinstance(regions, int) else np.asarray(regions)
    idx = rows.astype(np.int64)[:, None] * num_blocks + ids[None, :]
    return idx.ravel()


@dataclass(slots=True)
class Span:
    """Where a READ lands: a prepared local list of ``regions x num_blocks`` chunks (the
    pool, or a scratch buffer), the region rows used and the blocks."""

    dlist: Any
    num_blocks: int
    regions: Any  # int (all rows) or the row numbers
    block_ids: list[int]


@dataclass(slots=True)
class Scratch:
    """A buffer registered for one load's READs (a re-cut: ``recut.py``)."""

    tensor: torch.Tensor
    reg: Any
    dlist: Any


class PoolAgent:
    """See the module docstring. ``card`` is what handles carry."""

    def __init__(self, kv: torch.Tensor, layout: dict[str, Any], fingerprint: str) -> None:
        mod = load_nixl()
        self._mod = mod
        self.name = f"pdserve-{uuid.uuid4().hex}"
        config = mod.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        self.agent = mod.nixl_agent(self.name, config)
        raw = byte_view(kv)
        self.mem = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self.device = (kv.device.index or 0) if kv.device.type == "cuda" else 0
        self.num_blocks = kv.shape[2]
        self.regions = kv.shape[0] * kv.shape[1]
        self.region_bytes = raw[0, 0, 0].numel() * raw.element_size()
        self.block_bytes = self.region_bytes * self.regions
        base, nbytes = raw.data_ptr(), raw.numel() * raw.element_size()
        self._reg = self.agent.register_memory([(base, nbytes, self.device, "")], self.mem)
        count = self.regions * self.num_blocks
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(base, count, self.region_bytes, self.device), self.mem
        )
        self.card = Card(
            self.name,
            bytes(self.agent.get_agent_metadata()),
            self.mem,
            self.device,
            base,
            self.num_blocks,
            self.regions,
            self.region_bytes,
            fingerprint,
            layout,
        )
        self._peers: dict[str, tuple[bytes, Any]] = {}  # agent -> (metadata, prepped dlist)

    # -- peers -------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (to notify it); returns its agent name."""
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def knows(self, agent: str) -> bool:
        return agent in self._peers

    def remote_dlist(self, card: Card) -> Any:
        """The peer's whole pool as prepared descriptors (loading its metadata once)."""
        known = self._peers.get(card.agent)
        if known is not None and known[0] == card.metadata:
            return known[1]
        if known is not None:
            self.forget(card.agent)
        self.add_peer(card.metadata)
        count = card.regions * card.num_blocks
        descs = _descs(card.base, count, card.region_bytes, card.device)
        prepped = self.agent.prep_xfer_dlist(card.agent, descs, card.mem)
        self._peers[card.agent] = (card.metadata, prepped)
        return prepped

    def forget(self, agent: str) -> None:
        """Drop a peer (it restarted, or stopped answering): reloaded on its next card."""
        known = self._peers.pop(agent, None)
        if known is not None:
            self._release(known[1].release)
        self._release(lambda: self.agent.remove_remote_agent(agent))

    # -- transfers ----------------------------------------------------------------------------
    def read(
        self,
        card: Card,
        src_ids: list[int],
        dst: Span,
        notif: bytes,
        src_regions: Any = None,
    ) -> tuple[Any, str]:
        """Post a READ of the peer's blocks ``src_ids`` (region rows ``src_regions``, all
        by default) into ``dst``; the peer gets ``notif`` once the data has moved. Returns
        (handle, "DONE" | "PROC" | "ERR")."""
        remote = self.remote_dlist(card)
        rows = card.regions if src_regions is None else src_regions
        local_idx = block_indices(dst.block_ids, dst.regions, dst.num_blocks)
        remote_idx = block_indices(src_ids, rows, card.num_blocks)
        handle = self.agent.make_prepped_xfer(
            "READ",
            dst.dlist,
            local_idx.astype(np.int32),
            remote,
            remote_idx.astype(np.int32),
            notif,
        )
        return handle, self.agent.transfer(handle)

    def pool_span(self, block_ids: list[int], regions: Any = None) -> Span:
        """Blocks ``block_ids`` of this engine's pool (region rows ``regions``, all by
        default) as a READ's destination."""
        rows = self.regions if regions is None else regions
        return Span(self.local, self.num_blocks, rows, block_ids)

    def scratch(self, shape: tuple[int, ...], like: torch.Tensor) -> Scratch:
        """A ``[regions..., blocks, ...]`` buffer shaped like a cache (``shape``: layers,
        planes, blocks, block size, heads, dim), registered and prepared as chunks of
        one (layer, plane) of one block each; ``release_scratch`` undoes it."""
        tensor = torch.empty(shape, dtype=like.dtype, device=like.device)
        raw = byte_view(tensor)
        base, nbytes = raw.data_ptr(), raw.numel() * raw.element_size()
        reg = self.agent.register_memory([(base, nbytes, self.device, "")], self.mem)
        count = shape[0] * shape[1] * shape[2]
        chunk = nbytes // count
        dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(base, count, chunk, self.device), self.mem
        )
        return Scratch(tensor, reg, dlist)

    def release_scratch(self, scratch: Scratch) -> None:
        self._release(scratch.dlist.release)
        self._release(lambda: self.agent.deregister_memory(scratch.reg))

    def state(self, handle: Any) -> str:
        return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> bool:
        """Release a transfer handle; False while the backend still runs it (retry later)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - an active transfer cannot be released yet
            return False
        return True

    def notify(self, agent: str, message: bytes) -> bool:
        try:
            self.agent.send_notif(agent, message)
        except Exception as e:  # noqa: BLE001 - the peer is gone or unknown
            logger.info("nixl: notification to %s failed: %s", agent, e)
            return False
        return True

    def notifications(self) -> dict[str, list[bytes]]:
        notifs = self.agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in notifs.items()}

    def close(self) -> None:
        for agent in list(self._peers):
            self.forget(agent)
        self._release(self.local.release)
        self._release(lambda: self.agent.deregister_memory(self._reg))

    @staticmethod
    def _release(fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - best effort at shutdown
            logger.debug("nixl release: %s", e)
