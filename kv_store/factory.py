"""Connector construction: the connector a ``KVStoreSettings`` describes, for each role
(docs/design.md §3, "Connector"). ``kv_store/base.py`` is the interface and names no
implementation; this module is the one place that does:

- ``build_connector``: rank 0's connector, playing both roles (what the engine is given);
- ``across_ranks``: rank 0's worker side when N > 1 ranks each hold a shard of the cache;
- ``rank_worker``: a worker rank's end of rank 0's KV messages, which builds that rank's
  own connector with ``build_worker_connector``.

A store kind (``--connector`` / ``--kv-store``) maps to its builder in ``STORE_BUILDERS``, a
handoff connector (``--connector p2p|nixl``) to its builder in ``HANDOFF_BUILDERS``;
a new kind is one builder and one entry there. The settings, their flags and ``PDSERVE_*``
twins are declared once in ``kv_store/args.py`` (the table: docs/kv-store.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from common.sizes import parse_bytes
from kv_store.args import CONNECTORS, STORES, KVStoreSettings, add_cli_arguments
from kv_store.base import KVConnector, KVConnectorWorker, RankChannel, RankWorker
from kv_store.record_mac import record_mac

if TYPE_CHECKING:
    from kv_store.nixl import NixlConnector
    from kv_store.p2p import P2PConnector

# Re-exported: the settings model, its flags and the byte-size rule of --kv-capacity.
__all__ = [
    "CONNECTORS",
    "STORES",
    "HANDOFF_BUILDERS",
    "STORE_BUILDERS",
    "KVStoreSettings",
    "across_ranks",
    "add_cli_arguments",
    "build_connector",
    "build_worker_connector",
    "parse_bytes",
    "rank_worker",
]


def build_connector(settings: KVStoreSettings, host: str = "127.0.0.1") -> KVConnector | None:
    """The connector ``settings`` describe, or None for ``none``. Raises ``ValueError`` on
    bad settings and ``KVStoreError`` when the store cannot be reached at start. ``host``:
    the service's listen address, where p2p serves pulls unless ``p2p_host`` says."""
    connector = _build(settings, host)
    if connector is not None and "lmcache" not in (settings.connector, settings.kv_store):
        # LMCache keys KV by token prefix, not by our per-rank records: no rank spec, so an
        # engine with tensor_parallel_size > 1 refuses it (docs/design.md §3).
        connector.rank_spec = {"settings": dataclasses.asdict(settings), "host": host}
    return connector


def build_worker_connector(spec: dict[str, Any], rank: int) -> KVConnector:
    """The connector tensor-parallel rank ``rank`` runs for its shard, from rank 0's
    ``rank_spec``. A fixed ``--p2p-port`` P gives rank r the port P + r."""
    settings = KVStoreSettings(**spec["settings"])
    if settings.p2p_port:
        settings.p2p_port += rank
    connector = _build(settings, str(spec["host"]))
    if connector is None:
        raise ValueError("the rank spec names no connector")
    return connector


def across_ranks(
    worker: KVConnectorWorker, channel: RankChannel, timeout_s: float
) -> KVConnectorWorker:
    """Rank 0's worker when ``channel.size`` ranks each hold a shard of the cache: every
    transfer reaches every rank's worker, in order with the steps, and is reported once
    all have finished (docs/design.md §3, "KV with tensor parallelism"). Not yet bound;
    ``timeout_s`` bounds the workers' binding. ``ValueError`` when ``worker`` cannot run
    per rank (``check_ranks``)."""
    worker.check_ranks(channel.size)
    from kv_store.tp_connector import TPConnector  # the fan-out: loaded when used

    return TPConnector(worker, channel, timeout_s)


def rank_worker(rank: int, host: str | None = None) -> RankWorker:
    """The end of rank 0's KV messages that worker rank ``rank`` runs; it builds its own
    connector from the ``rank_spec`` in the ``bind`` message (``kv_store/tp_worker.py``).
    ``host``: this rank's own address, when it is not on rank 0's host (p2p serves there)."""
    from kv_store.tp_worker import TPRankWorker  # the fan-out: loaded when used

    return TPRankWorker(rank, build_worker_connector, host)


def _build(settings: KVStoreSettings, host: str) -> KVConnector | None:
    settings.validate()
    handoff = HANDOFF_BUILDERS.get(settings.connector)
    if handoff is None:
        return _build_store(settings, settings.connector)
    direct = handoff(settings, host)
    store = _build_store(settings, settings.kv_store)  # --kv-store: a tier beside the handoff
    if store is None:
        return direct
    from kv_store.p2p.composed import P2PWithStore

    return P2PWithStore(direct, store)


def _p2p(settings: KVStoreSettings, host: str) -> P2PConnector:
    from kv_store.p2p import P2PConnector

    return P2PConnector(
        host=settings.p2p_host or host,
        port=settings.p2p_port,
        lease_s=settings.p2p_lease_s,
        timeout_s=settings.p2p_timeout_s,
        token=settings.p2p_token,
    )


def _nixl(settings: KVStoreSettings, host: str) -> NixlConnector:
    """NIXL handoff: its agent's metadata rides in the handles, so no port of its own."""
    from kv_store.nixl import NixlConnector

    return NixlConnector(
        lease_s=settings.p2p_lease_s, timeout_s=settings.p2p_timeout_s, token=settings.p2p_token
    )


def _build_store(settings: KVStoreSettings, kind: str) -> KVConnector | None:
    if kind == "none":
        return None
    return STORE_BUILDERS[kind](settings)


def _fs(settings: KVStoreSettings) -> KVConnector:
    from kv_store.block_connector import BlockStoreConnector
    from kv_store.fs_backend import FsBackend

    assert settings.kv_path is not None
    fs = FsBackend(
        settings.kv_path,
        ttl_s=settings.kv_ttl or None,
        capacity_bytes=settings.kv_capacity or None,
        key_prefix=settings.key_prefix,
    )
    return BlockStoreConnector(fs, name="fs", mac=record_mac(settings.kv_secret))


def _redis(settings: KVStoreSettings) -> KVConnector:
    from kv_store.block_connector import BlockStoreConnector
    from kv_store.redis_backend import RedisBackend

    assert settings.redis_url is not None
    rb = RedisBackend(
        settings.redis_url, ttl_s=settings.kv_ttl or None, key_prefix=settings.key_prefix
    )
    rb.ping()  # fail loudly at start rather than on the first request
    return BlockStoreConnector(rb, name="redis", mac=record_mac(settings.kv_secret))


def _lmcache(settings: KVStoreSettings) -> KVConnector:
    from kv_store.lmcache_connector import LMCacheConnector

    assert settings.lmcache_url is not None
    return LMCacheConnector(settings.lmcache_url, local_cpu_bytes=settings.kv_capacity or None)


# The registries: each store kind's builder (validated settings in, a connector out), and
# each handoff connector's (also given this service's address); a handoff composes with the
# store of --kv-store.
STORE_BUILDERS: Mapping[str, Callable[[KVStoreSettings], KVConnector]] = MappingProxyType(
    {"fs": _fs, "redis": _redis, "lmcache": _lmcache}
)
HANDOFF_BUILDERS: Mapping[str, Callable[[KVStoreSettings, str], P2PConnector | NixlConnector]] = (
    MappingProxyType({"p2p": _p2p, "nixl": _nixl})
)
