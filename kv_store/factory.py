"""Connector selection: the connector a ``KVStoreSettings`` describes (docs/design.md §3).

The settings, their flags and ``PDSERVE_*`` twins are declared once in ``kv_store/args.py``
(the table: docs/kv-store.md); this module builds from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.sizes import parse_bytes
from kv_store.args import CONNECTORS, STORES, KVStoreSettings, add_cli_arguments
from kv_store.base import KVConnector
from kv_store.record_mac import record_mac

# Re-exported: the settings model, its flags and the byte-size rule of --kv-capacity.
__all__ = ["CONNECTORS", "STORES", "KVStoreSettings", "add_cli_arguments", "parse_bytes"]


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


def _build(settings: KVStoreSettings, host: str) -> KVConnector | None:
    settings.validate()
    if settings.connector == "p2p":
        from kv_store.p2p import P2PConnector

        p2p = P2PConnector(
            host=settings.p2p_host or host,
            port=settings.p2p_port,
            lease_s=settings.p2p_lease_s,
            timeout_s=settings.p2p_timeout_s,
            token=settings.p2p_token,
        )
        store = _build_store(settings, settings.kv_store)
        if store is None:
            return p2p
        from kv_store.p2p.composed import P2PWithStore

        return P2PWithStore(p2p, store)
    return _build_store(settings, settings.connector)


def _build_store(settings: KVStoreSettings, kind: str) -> KVConnector | None:
    ttl = settings.kv_ttl or None
    cap = settings.kv_capacity or None
    if kind == "none":
        return None
    if kind == "fs":
        from kv_store.block_connector import BlockStoreConnector
        from kv_store.fs_backend import FsBackend

        assert settings.kv_path is not None
        fs = FsBackend(
            settings.kv_path, ttl_s=ttl, capacity_bytes=cap, key_prefix=settings.key_prefix
        )
        return BlockStoreConnector(fs, name="fs", mac=record_mac(settings.kv_secret))
    if kind == "redis":
        from kv_store.block_connector import BlockStoreConnector
        from kv_store.redis_backend import RedisBackend

        assert settings.redis_url is not None
        rb = RedisBackend(settings.redis_url, ttl_s=ttl, key_prefix=settings.key_prefix)
        rb.ping()  # fail loudly at start rather than on the first request
        return BlockStoreConnector(rb, name="redis", mac=record_mac(settings.kv_secret))
    from kv_store.lmcache_connector import LMCacheConnector

    assert settings.lmcache_url is not None
    return LMCacheConnector(settings.lmcache_url, local_cpu_bytes=cap)
