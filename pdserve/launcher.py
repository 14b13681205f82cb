"""`pdserve up`: the whole system on one machine, as child processes.

Starts the KV store when one is needed and not given (``redis-server`` or ``lmcache_server``
on a free port; the ``fs`` store is a temporary directory), N prefill and M decode services,
and the router on ``--host:--port``. Each child runs in its own process group with its
output in a log file, and each engine process gets a fair share of the cores as torch
threads; with ``--gpus N`` / ``--gpu-ids`` each engine is pinned to one GPU
(``CUDA_VISIBLE_DEVICES``). It waits (with a deadline) until every part reports healthy,
prints a line containing ``pdserve is ready``, then supervises: Ctrl-C or SIGTERM stops
everything, and a child that dies is restarted with backoff up to a crash-loop limit
(``pdserve/supervise.py``). How children are started, probed and stopped:
``pdserve/procs.py``; the run's temporary directory: ``pdserve/workdir.py``; the KV store
child and the connector flags: ``pdserve/up_store.py``.

Torch-free: only the children load engines.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from common.flags import fair_thread_share
from common.grpc_tls import FLAGS as TLS_FLAGS
from common.grpc_tls import TlsFiles
from common.grpc_token import ENV as GRPC_TOKEN_ENV
from common.grpc_token import new_token
from common.memory_budget import (
    DEFAULT_CPU_KV_CACHE,
    EngineMemory,
    check_host,
    host_memory_bytes,
)
from common.settings import forwarded_words
from kv_store.record_mac import ENV as KV_SECRET_ENV
from pdserve.gpus import (
    gpu_ids,
    gpu_share_flags,
)
from pdserve.instances import InstanceTable, ServicePorts
from pdserve.pool_parallel import assign_gpu_groups, check_pool_sizes, engine_sizes, pool_flags
from pdserve.procs import (
    Child,
    Interrupted,
    Launcher,
    LaunchError,
    free_ports,
    grpc_probe,
    router_probe,
)
from pdserve.supervise import RestartPolicy, Supervisor
from pdserve.up_args import add_up_arguments
from pdserve.up_store import store_flags
from pdserve.workdir import make_workdir, remove_stale_workdirs
from router.args import RouterArgs
from router.tools.flags import check_tool_flags
from service.settings import forward_engine_flags

logger = logging.getLogger(__name__)


def _engine_flags(
    args: argparse.Namespace, model_dir: str, threads: int, workdir: Path
) -> list[str]:
    """Flags every engine service gets (the GPU share is added per engine). The engines
    share compiled grammars in the run directory unless told another one (a request's
    prefill and decode then compile its guide once)."""
    flags = ["--model", model_dir, "--device", args.device, "--torch-threads", str(threads)]
    if not args.guided_cache_dir:
        flags += ["--guided-cache-dir", str(workdir / "grammars")]
    return flags + _tracing_flags(args) + forward_engine_flags(args)


def _tracing_flags(args: argparse.Namespace) -> list[str]:
    """Every child traces to the one endpoint (docs/running.md "Tracing")."""
    endpoint = args.otlp_traces_endpoint
    return ["--otlp-traces-endpoint", endpoint] if endpoint else []


def build_plan(
    launcher: Launcher, model_dir: str
) -> tuple[list[Child], list[Child], dict[str, str]]:
    """Declare every child: (store children, service + router children, service env)."""
    args = launcher.args
    num_engines = args.prefill + args.decode
    threads = args.torch_threads or fair_thread_share(num_engines)
    connector_flags, store = ([], None) if args.mode == "colocated" else store_flags(launcher, args)
    engine_flags = _engine_flags(args, model_dir, threads, launcher.workdir)
    gpus = assign_gpu_groups(engine_sizes(args), gpu_ids(args))
    ports = free_ports(2 * num_engines)
    # mTLS: one certificate for the services and the router (it must name 127.0.0.1, or
    # --grpc-tls-server-name, and allow both TLS server and client use).
    tls = TlsFiles.load(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca)
    tls_flags = _tls_flags(args) if tls is not None else []
    table = InstanceTable(launcher.workdir / "instances.json", tls, args.grpc_tls_server_name)
    launcher.instances = table
    services: list[Child] = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port, metrics_port = ports.pop(), ports.pop()
            address = f"127.0.0.1:{port}"
            listen = f"--host 127.0.0.1 --port {port} --metrics-port {metrics_port}".split()
            gpu = gpus[len(services)]
            share = gpu_share_flags(args.device, gpu, gpus, args.gpu_memory_utilization)
            # Speculation speeds up decode steps; a prefill instance samples one token only.
            spec = (
                ["--speculative", args.speculative] if role == "decode" and args.speculative else []
            )
            pooled = pool_flags(engine_flags, args, role)  # this pool's own TP / PP
            argv = launcher.python(role, *listen, *pooled, *spec, *share, *connector_flags)
            argv += tls_flags
            probe = grpc_probe(address, tls, args.grpc_tls_server_name)
            child = launcher.add(f"{role}-{i}", argv, probe)
            if gpu is not None:
                child.env_extra["CUDA_VISIBLE_DEVICES"] = gpu
                logger.info("%s-%d on GPU %s", role, i, gpu)
            services.append(child)
            table.add(child.name, ServicePorts(role, port, metrics_port))
    # The router follows a file rather than fixed lists: a service the supervisor moves
    # to new ports (its own were taken) is found there (docs/design.md §5, "Supervision").
    table.write()
    router_argv = launcher.python(
        *["router", "--host", args.host, "--port", str(args.port), "--mode", args.mode],
        *["--model", model_dir, "--served-model-name", args.served_model_name or args.model],
        *["--discovery", "file", "--instances-file", str(table.path)],
        *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
        *forwarded_words(RouterArgs.forwarded(), args),  # the tool flags, as given
        *_tracing_flags(args),
        *tls_flags,
        *(["--grpc-tls-server-name", args.grpc_tls_server_name] if tls_flags else []),
    )
    health_url = f"http://{_connect_host(args.host)}:{args.port}/health"
    router = launcher.add(
        "router",
        router_argv,
        router_probe(health_url, {"prefill": args.prefill, "decode": args.decode}),
    )
    if args.api_key:  # by environment: argv is visible to every user of the machine (ps)
        router.env_extra["PDSERVE_API_KEY"] = args.api_key
    # Per run: only this run's router may call its services, unless the caller sets one
    # (a router started beside the run, e.g. a second router, needs the same token).
    token = os.environ.get(GRPC_TOKEN_ENV) or new_token()
    for child in (*services, router):
        child.env_extra[GRPC_TOKEN_ENV] = token
    # Per run unless the caller sets one (a store shared beyond this run needs the same
    # secret everywhere): only this run's services can write records its decodes load.
    kv_secret = os.environ.get(KV_SECRET_ENV) or new_token()
    for child in services:
        child.env_extra[KV_SECRET_ENV] = kv_secret  # by environment, never argv (ps)
    logger.info("%d engine process(es), %d torch thread(s) each", num_engines, threads)
    return ([store] if store else []), [*services, router], launcher.child_env(threads)


def _tls_flags(args: argparse.Namespace) -> list[str]:
    """The mTLS file flags, passed on as given (paths, not secrets: argv is fine)."""
    words: list[str] = []
    for flag in TLS_FLAGS:
        words += [flag, os.path.abspath(getattr(args, flag.lstrip("-").replace("-", "_")))]
    return words


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _check_port_free(host: str, port: int) -> None:
    """Fail fast (and clearly) when the router's port is taken: another server there could
    even answer the health check in the router's place."""
    with socket.socket() as s:
        # As uvicorn binds: connections of a run that just ended (TIME-WAIT) do not block.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise LaunchError(
                f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port"
            ) from None


def _check_counts(args: argparse.Namespace) -> None:
    if args.prefill is None:
        args.prefill = 0 if args.mode == "colocated" else 1
    if args.decode < 1:
        raise LaunchError("--decode must be >= 1: decode instances stream every response")
    if args.mode == "disaggregated" and args.prefill < 1:
        raise LaunchError("--mode disaggregated needs --prefill >= 1 (or use --mode colocated)")
    if args.mode == "colocated" and args.prefill > 0:
        raise LaunchError(
            "--mode colocated runs no prefill instances: use --prefill 0 (or --mode auto)"
        )


def _check_memory(args: argparse.Namespace) -> None:
    """Every engine this run starts on the machine, against its memory (ValueError naming
    the sizes; common/memory_budget.py)."""
    kv = args.kv_cache_memory or DEFAULT_CPU_KV_CACHE
    engine = EngineMemory(args.device, kv, args.kv_offloading_size or 0)
    check_host([engine] * (args.prefill + args.decode), host_memory_bytes(), "this machine")


def run_up(args: argparse.Namespace) -> int:
    """Entry point of `pdserve up`: 0 after a requested stop, 1 when a part failed."""
    remove_stale_workdirs()  # of runs killed with SIGKILL, which could not clean up
    try:
        _check_counts(args)
        _check_memory(args)
        check_tool_flags(args)
        # Misuse of --gpus / --gpu-ids, or too few of them for N, fails before anything starts.
        assign_gpu_groups(engine_sizes(args), gpu_ids(args))
        TlsFiles.load(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca)  # so do certs
        _check_port_free(args.host, args.port)
        from common.models import resolve_model

        model_dir = resolve_model(args.model)  # a known model is pulled once; Ctrl-C stops it
        check_pool_sizes(str(model_dir), args)
    except (LaunchError, ValueError) as exc:
        _print(f"pdserve up failed: {exc}", err=True)
        return 1
    except KeyboardInterrupt:
        return 130
    workdir = make_workdir()
    log_dir = Path(args.log_dir) if args.log_dir else workdir / "logs"
    launcher = Launcher(args, workdir, log_dir)
    handlers = {
        s: signal.signal(s, lambda *_: launcher.stop_requested.set())
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        return _start_and_supervise(launcher, model_dir)
    except Interrupted:
        _print("pdserve: interrupted during startup; stopping")
        return 0
    except (LaunchError, ValueError) as exc:
        _print(f"pdserve up failed: {exc}", err=True)
        return 1
    finally:
        launcher.stop_all(args.shutdown_grace)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        shutil.rmtree(workdir, ignore_errors=True)


def _start_and_supervise(launcher: Launcher, model_dir: str) -> int:
    """Start the store, then services and router; wait until healthy; run until stopped."""
    args = launcher.args
    stores, parts, env = build_plan(launcher, model_dir)
    url = f"http://{_connect_host(args.host)}:{args.port}/v1"
    _print(f"pdserve: starting {len(parts) - 1} engine service(s) and the router for {model_dir}")
    _print(f"pdserve: logs in {launcher.log_dir}")
    deadline = time.monotonic() + args.startup_timeout
    launcher.start(stores, env)
    launcher.wait_healthy(stores, deadline)
    launcher.start(parts, env)
    _print(f"pdserve: router listening on {url} (mode {args.mode}); waiting until all are healthy")
    launcher.wait_healthy(parts, deadline)
    status = launcher.workdir / "status.json"
    supervisor = Supervisor(launcher, env, RestartPolicy(args.max_restarts), _print, status)
    supervisor.write_status()
    _print(f"pdserve: children, pids and restart counts in {status}")
    _print(f"pdserve is ready: {url} (Ctrl-C to stop)")
    supervisor.run()
    _print("pdserve: stopping")
    return 0


def _print(line: str, *, err: bool = False) -> None:
    """CLI output (the launcher's user interface), flushed at once for pipes and tests."""
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `pdserve up`; each flag also reads its ``PDSERVE_*`` twin (``--port`` ← PDSERVE_PORT)."""
    parser = subparsers.add_parser(
        "up", help="run router + prefill + decode services locally", description=__doc__
    )
    add_up_arguments(parser)  # declared once, in pdserve/up_args.py
    parser.set_defaults(func=run_up)
