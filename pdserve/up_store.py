"""The KV store `pdserve up` gives its services: the connector flags they get and, when
the store is not given (``--redis-url`` / ``--lmcache-url``), the private ``redis-server``
or ``lmcache_server`` child to start on a free port (the ``fs`` store is a directory in
the run's temporary directory). The store bounds (``--kv-capacity``, ``--kv-ttl``) are
passed on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from pdserve.procs import Child, Launcher, LaunchError, free_ports, tcp_probe


def _store_child(
    launcher: Launcher, args: argparse.Namespace, kind: str | None = None
) -> tuple[list[str], Child | None]:
    """The connector flags for the services, and the store process to start (if any)."""
    kind = kind or args.connector
    if kind in ("p2p", "nixl"):  # a handoff; with --kv-store, a store beside it (as usual)
        p2p = ["--connector", kind]
        p2p += ["--p2p-lease-seconds", args.p2p_lease_seconds] if args.p2p_lease_seconds else []
        p2p += ["--p2p-timeout", args.p2p_timeout] if args.p2p_timeout else []
        if args.kv_store in (None, "", "none"):
            return p2p, None
        flags, child = _store_child(launcher, args, args.kv_store)
        return [*p2p, "--kv-store", args.kv_store, *flags[2:]], child
    if kind == "fs":
        path = args.kv_path or str(launcher.workdir / "kv")
        return ["--connector", "fs", "--kv-path", path], None
    if kind == "redis":
        if args.redis_url:
            return ["--connector", "redis", "--redis-url", args.redis_url], None
        binary = _require_tool(
            "redis-server", "install it (apt-get install redis-server) or pass --redis-url"
        )
        (port,) = free_ports(1)
        options = f"--port {port} --bind 127.0.0.1 --appendonly no".split()
        # No snapshots: the store is a cache, not a database.
        argv = [binary, *options, "--save", "", "--dir", str(launcher.workdir)]
        child = launcher.add("redis", argv, tcp_probe(port, b"PING\r\n", b"+PONG"))
        return ["--connector", "redis", "--redis-url", f"redis://127.0.0.1:{port}/0"], child
    if args.lmcache_url:
        return ["--connector", "lmcache", "--lmcache-url", args.lmcache_url], None
    binary = _require_tool(
        "lmcache_server",
        "install the lmcache extra (pip install 'pdserve[lmcache]') or pass --lmcache-url",
    )
    (port,) = free_ports(1)
    child = launcher.add("lmcache", [binary, "127.0.0.1", str(port)], tcp_probe(port))
    return ["--connector", "lmcache", "--lmcache-url", f"lm://127.0.0.1:{port}"], child


# LMCache allocates (and touches) its whole local CPU buffer at start; the store's 10 GiB
# default would exhaust a small machine with two engines, so `up` asks for less.
LMCACHE_DEFAULT_CAPACITY = "1GiB"


def store_flags(launcher: Launcher, args: argparse.Namespace) -> tuple[list[str], Child | None]:
    """``_store_child`` plus the store bounds (``--kv-ttl``, ``--kv-capacity``) to pass on."""
    flags, child = _store_child(launcher, args)
    store = args.kv_store if args.connector in ("p2p", "nixl") else args.connector
    capacity = args.kv_capacity or (LMCACHE_DEFAULT_CAPACITY if store == "lmcache" else None)
    if capacity:
        flags += ["--kv-capacity", capacity]
    if args.kv_ttl:
        flags += ["--kv-ttl", args.kv_ttl]
    return flags, child


def _require_tool(name: str, hint: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if not found:
        raise LaunchError(f"{name} not found on PATH: {hint}")
    return found
