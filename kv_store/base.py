"""The KV connector interface (docs/design.md §3, "Connector"): the one module of
``kv_store`` the engine imports. Split by role, as vLLM V1 splits its connector:

- ``KVConnectorScheduler``, the scheduler side: one per engine, in the engine's own process
  (rank 0 under tensor parallelism). ``lookup`` (side-effect free: how many leading blocks
  the store holds), the transfer counters (``stats``) and the transport's own figures
  (``transport_stats``, opaque to the engine).
- ``KVConnectorWorker``, the worker side: one per rank, moving bytes between that rank's
  paged cache and the store or a peer. ``start_save`` / ``start_load`` run on background
  threads and ``poll`` reports finished transfers, so the step loop never blocks on I/O. A
  save may be reported ``held`` (its blocks stay in this cache for a peer to read) until a
  result of kind ``"release"``; ``release_held`` ends a hold early.
- ``KVConnector``: one connector playing both roles, what ``kv_store.factory`` builds and
  the engine is given. The engine keeps it as its scheduler side and moves bytes through
  its worker side, or, with N > 1 ranks, through ``kv_store.factory.across_ranks``: every
  rank runs a worker built from ``rank_spec`` and rank 0 merges their results.

This module is pure: it imports no implementation. The stores (``kv_store/backend.py`` and
the block records), p2p leases and pulls (``kv_store/p2p/``) and the rank fan-out
(``kv_store/tp_connector.py``, ``kv_store/tp_worker.py``) are built by
``kv_store/factory.py``, the one module that names them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

# The counters every connector keeps (plain numbers; exported as pdserve_kv_*).
from kv_store.stats import ConnectorStats as ConnectorStats

if TYPE_CHECKING:
    import torch


class KVStoreError(RuntimeError):
    """The store could not be reached or refused an operation."""

    reason = "unreachable"  # the transfer's failure reason (pdserve_kv_failures_total)


class KVStoreCircuitOpen(KVStoreError):
    """Refused without trying: the store failed repeatedly just now (``kv_store.breaker``)."""

    reason = "circuit_open"


class KVRecordError(ValueError):
    """A stored record is corrupt (bad magic, version, layout or checksum)."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a reader must agree on to interpret a block record."""

    version: int
    dtype: str  # the cache's storage dtype: float32 | bfloat16 | float16 | float8_e4m3fn
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Planes per layer: K and V (2), or one MLA latent per token (1; then num_kv_heads is
    # 1 and head_dim the latent and rope key's width, docs/design.md §3 "MLA latent cache").
    planes: int = 2


def layout_wire_dict(layout: KvLayout) -> dict[str, Any]:
    """The layout as a peer's hello, a NIXL card and a pin carry it: the plane count only
    when it is not K and V, so a K/V peer of an older version (whose dict has no
    ``planes``) compares equal, and an MLA latent cache is refused by name."""
    out: dict[str, Any] = {
        "version": layout.version,
        "dtype": layout.dtype,
        "block_size": layout.block_size,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
    }
    if layout.planes != 2:
        out["planes"] = layout.planes
    return out


@dataclass(slots=True)
class KVTransfer:
    """One request's blocks to move between the paged cache and the store.

    ``block_hashes[i]`` / ``block_ids[i]`` / ``block_num_tokens[i]`` describe block ``i`` of
    the request (the last one may be partial). Only blocks ``start_block..`` are moved.
    A load from a peer (p2p) also names where the blocks are held: ``source_address``
    (host:port of the prefill instance) and ``transfer_id`` (its lease). ``reshard``:
    the prefill split the blocks over another grid (``kv_store/reshard.py``).
    """

    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    block_ids: list[int]
    block_num_tokens: list[int]
    start_block: int = 0
    source_address: str = ""
    transfer_id: str = ""
    # A load of blocks another grid split (its tensor- or pipeline-parallel sizes differ):
    # ``kv_store.reshard.Reshard`` as JSON, None for this grid's own (docs/design.md §3).
    reshard: dict[str, Any] | None = None


@dataclass(slots=True)
class TransferResult:
    """A finished save or load. For a load, ``num_loaded_blocks`` counts the leading blocks
    (from ``start_block``) that arrived intact; the engine recomputes the rest.

    A save with ``held=True`` is committed but not copied: the connector holds the blocks
    for a peer to pull under ``transfer_id`` at ``source_address``, and the engine keeps
    them allocated until a later result of kind ``"release"`` (pulled, or the hold ended:
    ``failure_reason`` expired | aborted | closed) for the same request.
    """

    request_id: str
    kind: str  # "save" | "load" | "release"
    ok: bool
    num_loaded_blocks: int = 0
    num_saved_blocks: int = 0  # for a save: blocks actually written (the rest were present)
    keys: list[str] = field(default_factory=list)  # for a save: the keys of all blocks
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str | None = None
    failure_reason: str | None = None  # "missing" | "checksum" | "unreachable" | ...
    held: bool = False
    transfer_id: str = ""
    source_address: str = ""


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as uint8 when it is a one-byte float (float8, same shape), else
    ``t``: code that only moves cache bytes (the engine's K/V stores, staging, p2p, the
    LMCache glue) goes through this, since torch has no float8 ``index_put`` on the CPU and
    gloo cannot send float8."""
    if t.element_size() != 1 or not t.is_floating_point():
        return t
    import torch  # only for a float8 cache: settings code imports this module without torch

    return t.view(torch.uint8)


# -- the scheduler side ---------------------------------------------------------------------
class KVConnectorScheduler(abc.ABC):
    """What the engine's scheduler asks of the connector; one per engine.

    ``counters`` is updated by the connector's workers; readers (the service metrics, through
    ``LLMEngine.stats()``) take ``stats()``, a consistent snapshot, and never reach into the
    connector otherwise.
    """

    name: str = "base"
    counters: ConnectorStats

    @abc.abstractmethod
    def lookup(self, token_ids: list[int], block_hashes: list[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the store holds. No side effects."""

    def stats(self) -> ConnectorStats:
        """A consistent snapshot of the transfer counters (exported as ``pdserve_kv_*``)."""
        return self.counters.snapshot()

    def transport_stats(self) -> object | None:
        """A snapshot of the figures this connector's transport keeps beyond
        ``ConnectorStats`` (p2p: leases and pulls, ``kv_store.p2p.stats.P2PStats``), or None.
        The engine hands it on unread (``EngineStats.transport``); the service exports the
        kinds it knows."""
        return None


# -- the worker side ------------------------------------------------------------------------
class RankChannel(Protocol):
    """How rank 0 reaches the worker ranks 1..size-1: the engine's executor provides it
    (``engine/kv/tp.py``), ``kv_store.factory.across_ranks`` uses it."""

    size: int

    def send(self, message: dict[str, Any]) -> None:
        """Deliver ``message`` (JSON) to every worker rank, in order with the step inputs."""
        ...

    def receive(self) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, message)`` the workers sent since the last call; never blocks."""
        ...


class KVConnectorWorker(abc.ABC):
    """Moves KV blocks between one rank's paged cache and the store or a peer."""

    name: str = "base"
    # How another tensor-parallel rank builds a worker of the same kind for its own shard
    # (JSON; set by ``kv_store.factory.build_connector``). None: this worker cannot run per
    # rank, and an engine with tensor_parallel_size > 1 refuses it (``check_ranks``).
    rank_spec: dict[str, Any] | None = None

    @abc.abstractmethod
    def bind_kv_cache(
        self, kv_cache: torch.Tensor, layout: KvLayout, model_fingerprint: str
    ) -> None:
        """Called once with this rank's cache ``[layers, planes, blocks, block, heads, dim]``
        (``layout.planes``: 2 for K/V, 1 for an MLA latent cache)."""

    @abc.abstractmethod
    def start_save(self, transfer: KVTransfer) -> None:
        """Begin writing blocks ``start_block..`` that the store lacks. The engine keeps the
        blocks alive and unchanged until ``poll`` reports the save."""

    @abc.abstractmethod
    def start_load(self, transfer: KVTransfer) -> None:
        """Begin reading blocks ``start_block..`` into ``block_ids``. The engine does not
        touch those blocks until ``poll`` reports the load."""

    @abc.abstractmethod
    def poll(self) -> list[TransferResult]:
        """Finished transfers since the last call (non-blocking)."""

    def release_held(self, request_id: str) -> bool:
        """End the hold of a save reported ``held`` (the request was aborted); its
        ``"release"`` result follows. False when the request holds nothing."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop worker threads and release the store."""

    def check_ranks(self, size: int) -> None:
        """``ValueError`` when this worker cannot run on ``size`` ranks; the engine asks
        before it starts any rank."""
        if size > 1 and self.rank_spec is None:
            raise ValueError(
                f"the {self.name!r} KV connector cannot serve tensor_parallel_size > 1 or "
                "pipeline_parallel_size > 1 (no "
                "worker per rank can be built for it; LMCache keys KV by token prefix, not "
                "per-rank records); use --connector fs, redis, p2p or nixl"
            )


class KVConnector(KVConnectorScheduler, KVConnectorWorker):
    """A connector playing both roles (what the factory builds; docs/design.md §3)."""

    name: str = "base"


class RankWorker(Protocol):
    """A worker rank's end of the messages rank 0's ``across_ranks`` worker sends
    (``kv_store.factory.rank_worker`` builds it)."""

    def handle(self, message: dict[str, Any], kv_cache: torch.Tensor) -> list[dict[str, Any]]:
        """Act on one message (bind, save, load, release, close); returns the messages to
        send back to rank 0 now. Starts transfers, never waits for them."""
        ...

    def poll(self) -> list[dict[str, Any]]:
        """Messages for rank 0 about transfers finished since the last call."""
        ...

    def close(self) -> None: ...


def rank_fingerprint(model_fingerprint: str, rank: int, size: int) -> str:
    """The fingerprint rank ``rank`` of ``size`` keys its records under (unchanged for 1).

    Part of the interface: the tensor-parallel fan-out and the grid mapping of
    ``kv_store/reshard.py`` both name a rank's records by it (docs/design.md §3 "Connector").
    """
    return model_fingerprint if size == 1 else f"{model_fingerprint}-r{rank}"
