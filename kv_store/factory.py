"""Connector selection from flags and ``PDSERVE_*`` environment variables (docs/design.md §3).

| flag            | env                   | meaning                                        |
|-----------------|-----------------------|------------------------------------------------|
| --connector     | PDSERVE_CONNECTOR     | fs, redis, lmcache, p2p or none                |
| --kv-path       | PDSERVE_KV_PATH       | fs: the shared directory                       |
| --redis-url     | PDSERVE_REDIS_URL     | redis: redis://host:port[/db]                  |
| --lmcache-url   | PDSERVE_LMCACHE_URL   | lmcache: lm://host:port or redis://host:port   |
| --kv-ttl        | PDSERVE_KV_TTL        | seconds a block lives (0 = forever)            |
| --kv-capacity   | PDSERVE_KV_CAPACITY   | byte bound, e.g. 10GiB (common.sizes; fs store;|
|                 |                       | LMCache's CPU buffer); 0 = unbounded           |
| --kv-key-prefix | PDSERVE_KV_KEY_PREFIX | namespace before every key (Redis; fs path)    |
| --kv-secret     | PDSERVE_KV_SECRET     | fs, redis: seal records with a keyed MAC and   |
|                 |                       | refuse those that do not verify (record_mac.py)|
| --kv-store      | PDSERVE_KV_STORE      | p2p: also save to fs, redis or lmcache (prefix |
|                 |                       | reuse, fallback when the peer is unreachable)  |
| --p2p-host      | PDSERVE_P2P_HOST      | p2p: address to serve pulls on and put in      |
|                 |                       | handles (default: the service's --host; a      |
|                 |                       | wildcard advertises this machine's address)    |
| --p2p-port      | PDSERVE_P2P_PORT      | p2p: control port (0 = a free port)            |
| --p2p-lease-seconds | PDSERVE_P2P_LEASE_SECONDS | p2p: how long a prefill holds blocks |
|                 |                       | for the pull (default 30)                      |
| --p2p-timeout   | PDSERVE_P2P_TIMEOUT   | p2p: deadline of one pull, seconds (default 10)|
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.sizes import parse_bytes
from kv_store.base import KVConnector
from kv_store.record_mac import ENV as KV_SECRET_ENV
from kv_store.record_mac import record_mac

__all__ = ["parse_bytes"]  # re-exported: the byte-size rule of --kv-capacity

CONNECTORS = ("fs", "redis", "lmcache", "p2p", "none")
STORES = ("fs", "redis", "lmcache", "none")  # what --kv-store composes with p2p
DEFAULT_TTL_S = 3600.0
DEFAULT_CAPACITY = 10 * 1024**3


def _parse_port(text: str | int) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"invalid port {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {text!r}")
    return port


def _seconds(text: str | float, what: str, *, zero_means: str | None = None) -> float:
    """Seconds from a flag or env value: > 0, or >= 0 when 0 has a meaning (``zero_means``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"invalid {what} {text!r}: expected seconds") from None
    if value < 0 or (value == 0 and zero_means is None):
        bound = f">= 0 seconds (0 = {zero_means})" if zero_means else "> 0 seconds"
        raise ValueError(f"{what} must be {bound}, got {text!r}")
    return value


def _parse_seconds(text: str | float) -> float:
    return _seconds(text, "duration")


def _parse_ttl(text: str | float) -> float:
    return _seconds(text, "KV TTL", zero_means="no expiry")


@dataclass(slots=True)
class KVStoreSettings:
    """Which connector to build and how. ``kv_ttl`` / ``kv_capacity`` of 0 mean unbounded."""

    connector: str = "none"
    kv_path: str | None = None
    redis_url: str | None = None
    lmcache_url: str | None = None
    kv_ttl: float = DEFAULT_TTL_S
    kv_capacity: int = DEFAULT_CAPACITY
    key_prefix: str = ""
    kv_store: str = "none"  # with connector p2p: a store saved too
    p2p_host: str | None = None  # None: the service's own --host
    p2p_port: int = 0
    p2p_lease_s: float = 30.0
    p2p_timeout_s: float = 10.0
    # fs/redis: records carry a keyed BLAKE3 MAC under this secret (empty: checksums only).
    kv_secret: str = field(default="", repr=False)
    # p2p: the control-plane token a pulling peer must prove (empty: no check).
    p2p_token: str = field(default="", repr=False)

    @property
    def store_kind(self) -> str:
        """The store connector among the settings: ``connector`` itself, or for p2p the
        composed ``kv_store`` ("none" when p2p runs alone)."""
        return self.kv_store if self.connector == "p2p" else self.connector

    def validate(self) -> None:
        """``ValueError`` naming the flag to fix."""
        if self.connector not in CONNECTORS:
            raise ValueError(
                f"--connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}"
            )
        if self.kv_store not in STORES:
            raise ValueError(
                f"--kv-store must be one of {', '.join(STORES)}, got {self.kv_store!r}"
            )
        if self.kv_store != "none" and self.connector != "p2p":
            raise ValueError("--kv-store composes a store with --connector p2p only")
        if not 0 <= self.p2p_port <= 65535:
            raise ValueError(f"--p2p-port must be in 0..65535, got {self.p2p_port}")
        if self.p2p_lease_s <= 0 or self.p2p_timeout_s <= 0:
            raise ValueError("--p2p-lease-seconds and --p2p-timeout must be > 0")
        if self.kv_ttl < 0:
            raise ValueError(f"--kv-ttl must be >= 0, got {self.kv_ttl}")
        if self.kv_capacity < 0:
            raise ValueError(f"--kv-capacity must be >= 0, got {self.kv_capacity}")
        need = {
            "fs": ("kv_path", "--kv-path / PDSERVE_KV_PATH"),
            "redis": ("redis_url", "--redis-url / PDSERVE_REDIS_URL"),
            "lmcache": ("lmcache_url", "--lmcache-url / PDSERVE_LMCACHE_URL"),
        }
        kind = self.store_kind
        if kind in need:
            attr, flag = need[kind]
            if not getattr(self, attr):
                raise ValueError(f"--connector {self.connector} needs {flag}")
        if kind == "redis" and not str(self.redis_url).startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"--redis-url must look like redis://host:port, got {self.redis_url!r}"
            )
        if kind == "lmcache" and not str(self.lmcache_url).startswith(("lm://", "redis://")):
            raise ValueError(
                f"--lmcache-url must look like lm://host:port or redis://host:port, got {self.lmcache_url!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KVStoreSettings:
        """Settings from ``PDSERVE_*`` variables (``os.environ`` by default)."""
        env = os.environ if env is None else env
        s = cls(
            connector=env.get("PDSERVE_CONNECTOR", "none").strip().lower(),
            kv_path=env.get("PDSERVE_KV_PATH") or None,
            redis_url=env.get("PDSERVE_REDIS_URL") or None,
            lmcache_url=env.get("PDSERVE_LMCACHE_URL") or None,
            kv_ttl=_parse_ttl(env.get("PDSERVE_KV_TTL", DEFAULT_TTL_S)),
            kv_capacity=parse_bytes(env.get("PDSERVE_KV_CAPACITY", DEFAULT_CAPACITY)),
            key_prefix=env.get("PDSERVE_KV_KEY_PREFIX", ""),
            kv_store=env.get("PDSERVE_KV_STORE", "none").strip().lower(),
            p2p_host=env.get("PDSERVE_P2P_HOST") or None,
            p2p_port=_parse_port(env.get("PDSERVE_P2P_PORT", "0")),
            p2p_lease_s=_parse_seconds(env.get("PDSERVE_P2P_LEASE_SECONDS", "30")),
            p2p_timeout_s=_parse_seconds(env.get("PDSERVE_P2P_TIMEOUT", "10")),
            kv_secret=env.get(KV_SECRET_ENV, ""),
            p2p_token=env.get("PDSERVE_GRPC_TOKEN", ""),
        )
        s.validate()
        return s

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KVStoreSettings:
        """Settings from a namespace parsed with ``add_cli_arguments``; the p2p token is
        the service's ``--grpc-token`` when the namespace has one."""
        s = cls(
            args.connector,
            args.kv_path,
            args.redis_url,
            args.lmcache_url,
            args.kv_ttl,
            args.kv_capacity,
            args.kv_key_prefix,
            args.kv_store,
            args.p2p_host or None,
            args.p2p_port,
            args.p2p_lease_seconds,
            args.p2p_timeout,
            args.kv_secret,
            getattr(args, "grpc_token", "") or "",
        )
        s.validate()
        return s


def add_cli_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """Add the connector flags; each defaults to its ``PDSERVE_*`` twin, then the built-in."""
    env = os.environ if env is None else env
    g = parser.add_argument_group("KV store")
    g.add_argument(
        "--connector",
        choices=CONNECTORS,
        default=env.get("PDSERVE_CONNECTOR", "none").strip().lower(),
        help="KV connector (env PDSERVE_CONNECTOR)",
    )
    g.add_argument(
        "--kv-path",
        default=env.get("PDSERVE_KV_PATH") or None,
        help="fs connector directory (env PDSERVE_KV_PATH)",
    )
    g.add_argument(
        "--redis-url",
        default=env.get("PDSERVE_REDIS_URL") or None,
        help="redis connector URL, redis://host:port (env PDSERVE_REDIS_URL)",
    )
    g.add_argument(
        "--lmcache-url",
        default=env.get("PDSERVE_LMCACHE_URL") or None,
        help="LMCache remote, lm://host:port or redis://host:port (env PDSERVE_LMCACHE_URL)",
    )
    g.add_argument(
        "--kv-ttl",
        type=_parse_ttl,
        default=_parse_ttl(env.get("PDSERVE_KV_TTL", DEFAULT_TTL_S)),
        help="seconds a stored block lives, 0 = forever (env PDSERVE_KV_TTL)",
    )
    g.add_argument(
        "--kv-capacity",
        type=parse_bytes,
        default=parse_bytes(env.get("PDSERVE_KV_CAPACITY", DEFAULT_CAPACITY)),
        help="byte bound of the fs store / LMCache local buffer, e.g. 10GiB; 0 = unbounded "
        "(env PDSERVE_KV_CAPACITY)",
    )
    g.add_argument(
        "--kv-key-prefix",
        default=env.get("PDSERVE_KV_KEY_PREFIX", ""),
        help="namespace before every store key (env PDSERVE_KV_KEY_PREFIX)",
    )
    g.add_argument(
        "--kv-store",
        choices=STORES,
        default=env.get("PDSERVE_KV_STORE", "none").strip().lower(),
        help="with --connector p2p: also save to this store, for prefix reuse and as the "
        "fallback when the peer is unreachable (env PDSERVE_KV_STORE)",
    )
    g.add_argument(
        "--p2p-host",
        default=env.get("PDSERVE_P2P_HOST") or None,
        help="p2p: address to serve pulls on and to put in handles; default the service's "
        "--host (a wildcard advertises this machine's address) (env PDSERVE_P2P_HOST)",
    )
    g.add_argument(
        "--p2p-port",
        type=_parse_port,
        default=_parse_port(env.get("PDSERVE_P2P_PORT", "0")),
        help="p2p: control port, 0 = a free port (env PDSERVE_P2P_PORT)",
    )
    g.add_argument(
        "--p2p-lease-seconds",
        type=_parse_seconds,
        default=_parse_seconds(env.get("PDSERVE_P2P_LEASE_SECONDS", "30")),
        help="p2p: how long a prefill holds a request's blocks for the decode side's pull "
        "(env PDSERVE_P2P_LEASE_SECONDS)",
    )
    g.add_argument(
        "--p2p-timeout",
        type=_parse_seconds,
        default=_parse_seconds(env.get("PDSERVE_P2P_TIMEOUT", "10")),
        help="p2p: deadline of one pull (connect, rendezvous, data), seconds "
        "(env PDSERVE_P2P_TIMEOUT)",
    )
    g.add_argument(
        "--kv-secret",
        default=env.get(KV_SECRET_ENV, ""),
        help="fs/redis: seal every record with a keyed MAC (BLAKE3) under this secret and refuse "
        "records that do not verify; set it in production (prefer the environment twin: "
        "a command line is visible to every user) (env PDSERVE_KV_SECRET)",
    )


def build_connector(settings: KVStoreSettings, host: str = "127.0.0.1") -> KVConnector | None:
    """The connector ``settings`` describe, or None for ``none``. Raises ``ValueError`` on
    bad settings and ``KVStoreError`` when the store cannot be reached at start. ``host``:
    the service's listen address, where p2p serves pulls unless ``p2p_host`` says."""
    connector = _build(settings, host)
    if connector is not None and "lmcache" not in (settings.connector, settings.kv_store):
        # LMCache keys KV by token prefix, not by our per-rank records: no recipe, so an
        # engine with tensor_parallel_size > 1 refuses it (docs/design.md §3).
        connector.worker_recipe = {"settings": dataclasses.asdict(settings), "host": host}
    return connector


def build_worker_connector(recipe: dict[str, Any], rank: int) -> KVConnector:
    """The connector tensor-parallel rank ``rank`` runs for its shard, from rank 0's
    ``worker_recipe``. A fixed ``--p2p-port`` P gives rank r the port P + r."""
    settings = KVStoreSettings(**recipe["settings"])
    if settings.p2p_port:
        settings.p2p_port += rank
    connector = _build(settings, str(recipe["host"]))
    if connector is None:
        raise ValueError("the worker recipe names no connector")
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
