"""Helpers for the block-index tests: a router built exactly as ``pdserve router`` builds it
(``router.cli.build_app``), served by uvicorn on a free port in a thread of the test
process, so a test can read its index (on the router's own event loop) while real clients
talk to it over HTTP; and an engine's own view of its caches, read as a fresh
subscription's snapshot over real gRPC."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvicorn

from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from router.cli import add_router_arguments, build_app
from router.routing.kv_index import KvBlockIndex
from tests.servers import free_port
from tests.service_fixtures import ServiceProcess

T = TypeVar("T")
Index = dict[str, dict[bytes, int]]  # instance → block hash → tier mask


class _SharedLoop:
    """One event loop thread for every in-process router: gRPC's asyncio layer polls one
    loop per process, and routers on loops of their own threads trip over each other."""

    loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        if cls.loop is None:
            cls.loop = asyncio.new_event_loop()
            threading.Thread(target=cls.loop.run_forever, daemon=True).start()
        return cls.loop


class InProcessRouter:
    """``pdserve router`` with ``argv`` on the shared loop thread; ``close()`` stops it."""

    def __init__(self, model_dir: Path, argv: Sequence[str]) -> None:
        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        self.port = free_port()
        args = parser.parse_args(
            ["--model", str(model_dir), "--port", str(self.port), "--served-model-name", "tiny"]
            + ["--health-interval", "0.3", *argv]
        )
        self.app = build_app(args)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.loop = _SharedLoop.get()
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or self.serving.done():
                raise RuntimeError("the in-process router did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def on_loop(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """``fn()`` run on the router's event loop (the index's owner), its result here."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def pool(self, name: str) -> Any:
        orch = self.app.state.deps.orchestrator
        return orch.prefill_pool if name == "prefill" else orch.decode_pool

    def index(self, pool: str) -> Index:
        p = self.pool(pool)
        return self.on_loop(lambda: {i.url: p.kv_index.blocks_of(i.url) for i in p.instances()})

    def live(self, pool: str) -> dict[str, bool]:
        p = self.pool(pool)
        return self.on_loop(lambda: {i.url: p.events_live(i.url) for i in p.instances()})

    def subscriber(self, pool: str, url: str) -> Any:
        return self.pool(pool).kv_feeds.subscribers[url]

    def close(self) -> None:
        self.server.should_exit = True
        self.serving.result(30)


def engine_view(service: ServiceProcess, role: str, timeout: float = 10.0) -> dict[bytes, int]:
    """What the engine holds now (hash → tier mask): a new subscription's snapshot."""
    stub_cls = (
        pdserve_pb2_grpc.PrefillServiceStub
        if role == "prefill"
        else pdserve_pb2_grpc.DecodeServiceStub
    )
    with grpc.insecure_channel(service.address) as channel:
        call = stub_cls(channel).SubscribeKvEvents(pdserve_pb2.KvEventsRequest(), timeout=timeout)
        try:
            first = next(iter(call))
        finally:
            call.cancel()
    assert first.snapshot, "a subscription must start with a snapshot"
    index = KvBlockIndex()
    index.apply(service.address, first)
    return index.blocks_of(service.address)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def follows(router: InProcessRouter, services: dict[str, tuple[ServiceProcess, str]]) -> bool:
    """Whether the router's index equals every engine's own view right now."""
    for address, (service, role) in services.items():
        if router.index(role).get(address) != engine_view(service, role):
            return False
    return True
