"""``KVStoreSettings``: which connector a service builds and how, declared once
(docs/design.md §3 "Settings"; the flags' table is in docs/kv-store.md).

Each field is one setting: default, unit, the argparse type that converts and validates
it, help, its ``PDSERVE_*`` twin (from the flag) and the Helm value that sets it. The
services' connector flags (``add_cli_arguments``), ``from_env`` and ``from_args`` are
derived from the fields; ``validate`` holds the checks across them. ``kv_store.factory``
builds the connector from a ``KVStoreSettings``. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.settings import ArgsModel, setting
from common.sizes import parse_bytes

CONNECTORS = ("fs", "redis", "lmcache", "p2p", "nixl", "none")
STORES = ("fs", "redis", "lmcache", "none")  # what --kv-store composes with p2p / nixl
# The handoff connectors: the prefill holds the blocks under a lease, the decode pulls them
# (p2p over a process group, nixl by a NIXL READ); both compose with a store.
HANDOFFS = ("p2p", "nixl")
DEFAULT_TTL_S = 3600.0
DEFAULT_CAPACITY = 10 * 1024**3
GRPC_TOKEN_ENV = "PDSERVE_GRPC_TOKEN"  # the services' --grpc-token, which p2p reuses


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


def _name(text: str) -> str:
    """A connector or store name: case and surrounding blanks do not matter."""
    return text.strip().lower()


def _optional(text: str) -> str | None:
    """A string, empty = unset."""
    return text or None


@dataclass
class KVStoreSettings(ArgsModel):
    """Which connector to build and how. ``kv_ttl`` / ``kv_capacity`` of 0 mean unbounded."""

    GROUP = "KV store"

    connector: str = setting(
        "none", type=_name, choices=CONNECTORS, help="KV connector", helm="connector.type"
    )
    kv_path: str | None = setting(
        None, type=_optional, help="fs connector directory", helm="connector.fs.mountPath"
    )
    redis_url: str | None = setting(
        None,
        type=_optional,
        help="redis connector URL, redis://host:port",
        helm="connector.redis.url",
    )
    lmcache_url: str | None = setting(
        None,
        type=_optional,
        help="LMCache remote, lm://host:port or redis://host:port",
        helm="connector.lmcache.url",
    )
    kv_ttl: float = setting(
        DEFAULT_TTL_S,
        type=_parse_ttl,
        unit="s",
        help="seconds a stored block lives, 0 = forever",
        helm="connector.ttlSeconds",
    )
    kv_capacity: int = setting(
        DEFAULT_CAPACITY,
        type=parse_bytes,
        unit="bytes",
        help="byte bound of the fs store / LMCache local buffer, e.g. 10GiB; 0 = unbounded",
        helm="connector.capacity",
    )
    key_prefix: str = setting(
        "",
        flag="--kv-key-prefix",
        help="namespace before every store key",
        helm="kvKeyPrefix",
    )
    kv_store: str = setting(
        "none",
        type=_name,
        choices=STORES,
        help="with --connector p2p or nixl: also save to this store, for prefix reuse and as the "
        "fallback when the peer is unreachable",
        helm="connector.p2p.store",
    )
    p2p_host: str | None = setting(  # None: the service's own --host
        None,
        type=_optional,
        help="p2p: address to serve pulls on and to put in handles; default the service's "
        "--host (a wildcard advertises this machine's address)",
    )
    p2p_port: int = setting(
        0,
        type=_parse_port,
        help="p2p: control port, 0 = a free port",
        helm="connector.p2p.port",
    )
    p2p_lease_s: float = setting(
        30.0,
        flag="--p2p-lease-seconds",
        type=_parse_seconds,
        unit="s",
        help="p2p and nixl: how long a prefill holds a request's blocks for the decode side's pull",
        helm="connector.p2p.leaseSeconds",
    )
    p2p_timeout_s: float = setting(
        10.0,
        flag="--p2p-timeout",
        type=_parse_seconds,
        unit="s",
        help="p2p and nixl: deadline of one pull (connect, rendezvous or pin, data), seconds",
        helm="connector.p2p.timeoutSeconds",
    )
    # fs/redis: records carry a keyed BLAKE3 MAC under this secret (empty: checksums only).
    kv_secret: str = setting(
        "",
        repr=False,
        help="fs/redis: seal every record with a keyed MAC (BLAKE3) under this secret and "
        "refuse records that do not verify; set it in production (prefer the environment "
        "twin: a command line is visible to every user)",
    )
    # p2p, nixl: the control-plane token a pulling peer must prove (empty: no check). Not a
    # flag of its own: the service's --grpc-token.
    p2p_token: str = field(default="", repr=False)

    @property
    def store_kind(self) -> str:
        """The store connector among the settings: ``connector`` itself, or for a handoff
        (p2p, nixl) the composed ``kv_store`` ("none" when it runs alone)."""
        return self.kv_store if self.connector in HANDOFFS else self.connector

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
        if self.kv_store != "none" and self.connector not in HANDOFFS:
            raise ValueError("--kv-store composes a store with --connector p2p or nixl only")
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
    def from_env(cls, env: Mapping[str, str] | None = None, **extra: Any) -> KVStoreSettings:
        """Settings from ``PDSERVE_*`` variables (``os.environ`` by default); the p2p
        token is the services' ``PDSERVE_GRPC_TOKEN``."""
        env = os.environ if env is None else env
        extra.setdefault("p2p_token", env.get(GRPC_TOKEN_ENV, ""))
        return super().from_env(env, **extra)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **extra: Any) -> KVStoreSettings:
        """Settings from a namespace parsed with ``add_cli_arguments``; the p2p token is
        the service's ``--grpc-token`` when the namespace has one."""
        extra.setdefault("p2p_token", getattr(args, "grpc_token", "") or "")
        return super().from_args(args, **extra)


def add_cli_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """Add the connector flags; each defaults to its ``PDSERVE_*`` twin, then the built-in."""
    KVStoreSettings.add_arguments(parser, environ=env)
