"""Shared pytest fixtures. Servers are real processes on free 127.0.0.1 ports."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.servers import ManagedServer, start_lmcache, start_redis


def _threads_per_worker() -> int:
    """Under pytest-xdist, each worker's share of the cores; 0 when not a worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    return max(1, (os.cpu_count() or 1) // workers) if workers else 0


WORKER_THREADS = _threads_per_worker()
# Each xdist worker computes on its share of the cores, and so does every process it starts
# (they inherit the variable): two workers each running torch's default of one thread per
# core kept four OpenMP threads spinning on the 2-core machine, and the in-process engine
# and transformers tests ran 3x slower than alone (docs/testing.md "Threads").
if WORKER_THREADS:
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
    os.environ.setdefault("MKL_NUM_THREADS", str(WORKER_THREADS))


def pytest_configure(config: pytest.Config) -> None:
    if WORKER_THREADS:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Model fixtures (tiny random models, SmolLM2) live in their own module.
pytest_plugins = ["tests.model_fixtures", "tests.service_fixtures", "tests.xdist_crash_guard"]

# -- KV stores (kv_store tests, engine/service integration) -----------------------------------


@pytest.fixture(scope="session")
def redis_proc() -> Iterator[ManagedServer]:
    """A session-wide ``redis-server``; ``.stop()`` / ``.restart()`` for fault tests."""
    srv, _ = start_redis()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def redis_server(redis_proc: ManagedServer) -> str:
    """URL of the session Redis (restarted if a test left it down), flushed for each test."""
    if redis_proc.proc is None or redis_proc.proc.poll() is not None:
        redis_proc.start()
    import redis as redis_py

    client = redis_py.Redis(host="127.0.0.1", port=redis_proc.port, socket_timeout=5)
    try:
        client.flushall()
    finally:
        client.close()
    return f"redis://127.0.0.1:{redis_proc.port}"


@pytest.fixture(scope="session")
def lmcache_proc() -> Iterator[ManagedServer]:
    """A session-wide ``lmcache_server``. It cannot be flushed: tests isolate themselves
    with a fresh model fingerprint (LMCache keys include it)."""
    srv, _ = start_lmcache()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def lmcache_server(lmcache_proc: ManagedServer) -> str:
    """``lm://`` URL of the session ``lmcache_server`` (restarted if a test left it down)."""
    if lmcache_proc.proc is None or lmcache_proc.proc.poll() is not None:
        lmcache_proc.start()
    return f"lm://127.0.0.1:{lmcache_proc.port}"
