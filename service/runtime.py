"""Process lifecycle of an engine service (prefill or decode): build, serve, drain, exit.

``run_service`` binds the gRPC port (error-mapping interceptor, ``grpc.health.v1``) and the
``/metrics`` HTTP server first, loads the engine (health NOT_SERVING meanwhile; docs/design.md
§3, "Ports before the model"), starts serving, reports SERVING, and waits for SIGTERM or SIGINT. Then it drains: health turns NOT_SERVING, new requests are
refused with UNAVAILABLE, in-flight requests get ``--drain-grace`` seconds to finish, and
only then does the server stop and the engine shut down. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.grpc_tls import TlsFiles, parse_allowed
from common.memory_trim import MemoryTrimmer
from common.tracing import make_tracing
from engine.args import EngineArgs
from kv_store.args import KVStoreSettings
from kv_store.base import KVStoreError
from service.auth import AllowedClientsInterceptor, TokenAuthInterceptor
from service.core import EngineServiceCore
from service.errors import ErrorMappingInterceptor
from service.metrics import ServiceMetrics
from service.settings import ServiceSettings

logger = logging.getLogger(__name__)

# (server, core, connector name or None) -> the fully qualified service names it registered
Register = Callable[[grpc.aio.Server, EngineServiceCore, str | None], list[str]]


def _grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Server options. The receive limit is checked by gRPC once it holds the whole message
    (before it is parsed), so a huge authenticated message is refused RESOURCE_EXHAUSTED;
    an unauthenticated one is refused from its metadata before it is read (``service/
    auth.py``). Frames read and freed go back to the OS through ``MemoryTrimmer``
    (docs/design.md §3, "Bounded inputs"); docs/running.md sizes the limit."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", 64 << 20),
        # grpc binds with SO_REUSEADDR (a restart on the same port works at once, despite
        # TIME-WAIT); SO_REUSEPORT stays off: a second service on the port must fail.
        ("grpc.so_reuseport", 0),
        # Long-lived streams (SubscribeKvEvents) can be idle for minutes: ping idle
        # connections so a vanished subscriber's stream ends and its queue is dropped, and
        # let callers ping too (every 5 s at most) to watch the server the same way.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ]


def build_connector(store: KVStoreSettings, host: str) -> Any | None:
    """The KV connector the store settings name, or None for ``--connector none``."""
    from kv_store.factory import build_connector as factory_build

    return factory_build(store, host=host)


def run_service(args: argparse.Namespace, *, role: str, register: Register) -> int:
    """Run one service process until it is signalled; returns the exit status. The parsed
    flags become the three settings models here, once (docs/design.md §3 "Settings")."""
    settings = ServiceSettings.for_role(args, role)
    from engine.engine_process import configure_threads

    configure_threads(settings.torch_threads)
    try:
        engine_args = EngineArgs.from_args(args)
        store = KVStoreSettings.from_args(args)
        if engine_args.pipeline_stage > 0:  # a pipeline stage on its own host: no engine
            from service.stage import run_stage

            status = run_stage(settings, engine_args, store)
        else:
            status = asyncio.run(_serve(settings, engine_args, store, register))
    except (ValueError, KVStoreError) as exc:
        # Bad settings or an unreachable store at startup: one clear line, not a traceback.
        logger.error("%s service cannot start: %s", role, exc)
        status = 2
    _exit_despite_stray_threads(status)
    return status


def _exit_despite_stray_threads(status: int, timeout: float = 5.0) -> None:
    """Exit now if non-daemon threads that libraries started (LMCache's monitors, executor
    workers) would otherwise keep the stopped process alive: a drained service must end."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    stray = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if stray:
        logger.warning("exiting with threads still running: %s", ", ".join(stray))
        logging.shutdown()
        os._exit(status)


async def _serve(
    settings: ServiceSettings, engine_args: EngineArgs, store: KVStoreSettings, register: Register
) -> int:
    from engine.async_engine import AsyncLLMEngine, EngineDeadError
    from engine.executor import ExecutorFailure
    from engine.process_client import ProcessEngineClient

    role = settings.role
    # Before the engine loads: a bad certificate should not cost a model load first.
    tls = TlsFiles.load(settings.grpc_tls_cert, settings.grpc_tls_key, settings.grpc_tls_ca)
    if settings.grpc_allowed_clients and tls is None:
        raise ValueError("--grpc-allowed-clients needs mTLS (--grpc-tls-cert/-key/-ca)")
    metrics = ServiceMetrics.create(role)
    interceptors = _interceptors(settings, tls, metrics)
    interceptors.append(
        ErrorMappingInterceptor(
            metrics.record_outcome, unavailable=(EngineDeadError, ExecutorFailure)
        )
    )
    options = _grpc_options(settings.grpc_max_message_bytes)
    server = grpc.aio.server(interceptors=interceptors, options=options)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_server = None
    metrics_server = None
    engine: AsyncLLMEngine | ProcessEngineClient | None = None
    core: EngineServiceCore | None = None
    trimmer = MemoryTrimmer(settings.memory_trim_interval)
    try:
        # The ports are claimed before the engine loads: the engine's helpers (the tensor-
        # parallel store, gloo) bind ephemeral loopback ports and could otherwise take ours,
        # and a port already in use fails at once instead of after the model load.
        port = _listen(server, f"{settings.host}:{settings.port}", tls)
        if settings.grpc_health_port:
            health_server = await _serve_health(health_servicer, settings)
        if settings.metrics_port:
            metrics_server = _serve_metrics(metrics, settings)
        config = engine_args.create_engine_config()
        if engine_args.engine_process:
            # the connector is built in the engine process (docs/design.md §3 "Engine
            # thread or engine process"); here only its name travels into KV handles
            engine = ProcessEngineClient(config, store, settings.host, settings.torch_threads)
            await engine.start()
            connector_name = engine.connector_name
        else:
            connector = build_connector(store, settings.host)
            engine = AsyncLLMEngine(config, connector)
            await engine.start()
            connector_name = getattr(connector, "name", None) if connector is not None else None
        metrics.watch_engine(engine)
        core = EngineServiceCore(
            role=role,
            engine=engine,
            metrics=metrics,
            model_name=settings.model_name,
            max_waiting=settings.max_waiting,
            tracing=make_tracing(settings.otlp_traces_endpoint, f"pdserve-{role}"),
        )
        names = register(server, core, connector_name)
        await server.start()
        trimmer.start()
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "%s service serving on %s:%d (%s, metrics :%s, model %s, pid %d)",
            role,
            settings.host,
            port,
            "mTLS" if tls else "plaintext",
            settings.metrics_port or "off",
            settings.model_name,
            os.getpid(),
        )
        stop = asyncio.Event()
        watcher = asyncio.create_task(_stop_when_engine_dies(engine, stop))
        await _drain_on_signal(core, health_servicer, settings.drain_grace, stop)
        watcher.cancel()
        if engine.kv_events is not None:
            engine.kv_events.close()  # end the event streams now, not at the stop's grace
        await server.stop(grace=2.0)
    finally:
        trimmer.stop()
        if core is not None and core.tracing is not None:
            core.tracing.shutdown()  # export the spans still buffered
        if health_server is not None:
            await health_server.stop(grace=None)
        if engine is not None:
            await engine.shutdown()  # also closes the connector
        if metrics_server is not None:
            metrics_server.shutdown()
    if engine.fatal_error is not None:
        # Exit non-zero so the supervisor (pdserve up, Kubernetes) starts a fresh instance.
        logger.error("%s service stopped: the engine died (%s)", role, engine.fatal_error)
        return 1
    logger.info("%s service stopped", role)
    return 0


def _interceptors(
    settings: ServiceSettings, tls: TlsFiles | None, metrics: ServiceMetrics
) -> list[grpc.aio.ServerInterceptor]:
    """The authentication interceptors, outermost first: an unauthenticated or disallowed
    call goes no further (docs/design.md §3, "Control-plane security")."""
    chain: list[grpc.aio.ServerInterceptor] = []
    if settings.grpc_token:
        chain.append(TokenAuthInterceptor(settings.grpc_token, metrics.record_outcome))
    allowed = parse_allowed(settings.grpc_allowed_clients)
    if tls is not None and allowed:
        chain.append(AllowedClientsInterceptor(allowed, metrics.record_outcome))
    return chain


def _listen(server: grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind ``address`` (with mTLS when ``tls``); ValueError when it cannot be bound."""
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        # grpc's message is generic; the usual cause is another process on the port.
        how = "with mTLS " if tls else ""
        raise ValueError(f"cannot listen {how}on {address} (in use?): {exc}") from None


def _serve_metrics(metrics: ServiceMetrics, settings: ServiceSettings) -> Any:
    """The ``/metrics`` HTTP server; ValueError (one line at exit) when its port is taken."""
    try:
        return metrics.serve(settings.host, settings.metrics_port)
    except OSError as exc:
        address = f"{settings.host}:{settings.metrics_port}"
        raise ValueError(f"cannot serve metrics on {address} (in use?): {exc}") from None


async def _serve_health(health_servicer: Any, settings: ServiceSettings) -> grpc.aio.Server:
    """A second, plaintext server with only ``grpc.health.v1``: the kubelet's gRPC probes
    cannot present a client certificate. It shares the main server's health states."""
    server = grpc.aio.server(options=_grpc_options(settings.grpc_max_message_bytes))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _listen(server, f"{settings.host}:{settings.grpc_health_port}", None)
    await server.start()
    return server


async def _stop_when_engine_dies(engine: Any, stop: asyncio.Event, every_s: float = 0.2) -> None:
    """Set ``stop`` once the engine has died for good (a tensor-parallel rank failed): the
    service then goes NOT_SERVING, refuses new calls (the router fails over) and exits."""
    while engine.fatal_error is None:
        await asyncio.sleep(every_s)
    logger.error("engine died for good: %s; health NOT_SERVING, stopping", engine.fatal_error)
    stop.set()


async def _drain_on_signal(
    core: EngineServiceCore, health_servicer: Any, grace: float, stop: asyncio.Event
) -> None:
    """Block until SIGTERM/SIGINT (or ``stop`` is set), then drain: NOT_SERVING, refuse new,
    finish in-flight."""
    loop = asyncio.get_running_loop()
    hurry = asyncio.Event()

    def on_signal(signum: int) -> None:
        (hurry if stop.is_set() else stop).set()
        logger.info("received %s", signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop.wait()
    core.draining = True
    await health_servicer.enter_graceful_shutdown()
    logger.info("draining: %d request(s) in flight, up to %.1f s", core.num_inflight, grace)
    idle = asyncio.create_task(core.wait_idle(grace))
    hurried = asyncio.create_task(hurry.wait())
    done, _ = await asyncio.wait({idle, hurried}, return_when=asyncio.FIRST_COMPLETED)
    for task in (idle, hurried):
        task.cancel()
    if idle not in done or not idle.result():
        logger.warning(
            "drain ended with %d request(s) still in flight; they are cut off", core.num_inflight
        )
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(signum)
