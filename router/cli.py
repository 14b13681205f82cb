"""``pdserve router``: flags (each with a ``PDSERVE_*`` env twin) and the process entry.

``add_router_arguments(parser)`` adds the flags; ``run_router(args)`` builds the tokenizer,
discovery, pools and app, and serves until SIGINT/SIGTERM. Torch-free.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from common.flags import add_env_argument, add_env_switch, non_negative_int, positive_int
from common.grpc_tls import TlsFiles, add_tls_arguments
from router.discovery import (
    DnsDiscovery,
    EndpointSliceDiscovery,
    InstanceDiscovery,
    StaticDiscovery,
)
from router.metrics import RouterMetrics
from router.policies import POLICY_NAMES
from router.pool import InstancePool
from router.settings import RouterSettings
from router.tokenizer import PromptProcessor

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"prefill": 50051, "decode": 50052}


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _optional_positive_int(text: str) -> int | None:
    if text.strip().lower() in {"", "none", "0"}:
        return None
    return positive_int(text)


def add_router_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Every router flag; defaults come from ``PDSERVE_<FLAG>`` when set."""
    g = parser.add_argument_group("router")
    add_env_argument(g, "--host", default="127.0.0.1", help="HTTP listen address")
    add_env_argument(g, "--port", type=non_negative_int, default=8000, help="HTTP port")
    add_env_argument(
        g,
        "--model",
        default="smollm2",
        help="model name (see `pdserve models`) or local HF directory (tokenizer + config)",
    )
    add_env_argument(
        g,
        "--served-model-name",
        default="",
        help="name(s) clients use as `model`, comma-separated; default: the --model value",
    )
    add_env_argument(
        g,
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "colocated", "auto"],
        help="prefill placement",
    )
    add_env_argument(g, "--prefill-urls", default="", help="static prefill instances host:port,...")
    add_env_argument(g, "--decode-urls", default="", help="static decode instances host:port,...")
    add_env_argument(
        g,
        "--discovery",
        default="static",
        choices=["static", "k8s", "dns"],
        help="where instances come from",
    )
    add_env_argument(
        g, "--prefill-service", default="", help="k8s/dns: the prefill (headless) Service name"
    )
    add_env_argument(
        g, "--decode-service", default="", help="k8s/dns: the decode (headless) Service name"
    )
    add_env_argument(g, "--namespace", default="default", help="k8s: namespace of the Services")
    add_env_argument(
        g,
        "--service-port",
        type=non_negative_int,
        default=0,
        help="k8s/dns: gRPC port of both pools; 0 = 50051 prefill, 50052 decode",
    )
    add_env_argument(
        g,
        "--k8s-api-url",
        default="",
        help="k8s: API URL (default: in-cluster config, else kubeconfig)",
    )
    add_env_argument(
        g,
        "--prefill-policy",
        default="least_load",
        choices=list(POLICY_NAMES),
        help="prefill routing policy",
    )
    add_env_argument(
        g,
        "--decode-policy",
        default="least_load",
        choices=list(POLICY_NAMES),
        help="decode routing policy",
    )
    add_env_argument(
        g,
        "--api-key",
        default="",
        help="require 'Authorization: Bearer KEY' on every path but /health "
        "(comma-separated for several keys)",
    )
    add_env_argument(
        g,
        "--grpc-token",
        default="",
        help="send 'authorization: Bearer TOKEN' on every gRPC call (the services' "
        "--grpc-token; prefer the environment twin)",
    )
    add_tls_arguments(g, server=False)
    add_env_switch(
        g,
        "--public-metrics",
        help="serve /metrics without the API key (for scrapers that cannot send one)",
    )
    add_env_argument(
        g,
        "--max-prompt-tokens",
        type=_optional_positive_int,
        default=None,
        help="longest prompt accepted (400 beyond); default: model context",
    )
    add_env_argument(
        g,
        "--max-model-len",
        type=_optional_positive_int,
        default=None,
        help="context length (prompt + output); default: from config.json",
    )
    add_env_argument(
        g,
        "--max-body-bytes",
        type=positive_int,
        default=4 * 1024 * 1024,
        help="largest request body (413 beyond)",
    )
    add_env_argument(
        g,
        "--request-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds a request may take end to end",
    )
    add_env_argument(
        g,
        "--prefill-timeout",
        type=_positive_float,
        default=60.0,
        help="deadline of one Prefill call",
    )
    add_env_argument(
        g,
        "--prefill-retries",
        type=non_negative_int,
        default=2,
        help="extra prefill attempts on other instances",
    )
    add_env_argument(
        g,
        "--decode-failovers",
        type=non_negative_int,
        default=3,
        help="times a stream may resume on another decode instance",
    )
    add_env_argument(
        g,
        "--stream-idle-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a decode stream may go without a chunk before it resumes elsewhere",
    )
    add_env_argument(
        g,
        "--health-interval",
        type=_positive_float,
        default=2.0,
        help="seconds between health checks",
    )
    add_env_argument(
        g,
        "--health-timeout",
        type=_positive_float,
        default=1.0,
        help="deadline of one health check / GetLoad",
    )
    add_env_argument(
        g,
        "--max-concurrent-requests",
        type=non_negative_int,
        default=0,
        help="429 beyond this many in-flight requests; 0 = no limit",
    )
    add_env_argument(
        g,
        "--block-size",
        type=positive_int,
        default=16,
        help="KV block size of the engines (prefix hashing)",
    )


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    names = _csv(args.served_model_name) or [args.model]
    return RouterSettings(
        served_model_names=names,
        mode=args.mode,
        api_keys=_csv(args.api_key),
        public_metrics=args.public_metrics,
        max_prompt_tokens=args.max_prompt_tokens,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        prefill_timeout=args.prefill_timeout,
        prefill_retries=args.prefill_retries,
        decode_failovers=args.decode_failovers,
        stream_idle_timeout=args.stream_idle_timeout,
        max_concurrent_requests=args.max_concurrent_requests,
    )


def make_discovery(args: argparse.Namespace, role: str) -> InstanceDiscovery:
    """The instance source of pool ``role`` ("prefill" or "decode") per ``--discovery``."""
    if args.discovery == "static":
        return StaticDiscovery(getattr(args, f"{role}_urls"))
    service = getattr(args, f"{role}_service")
    if not service:
        raise SystemExit(f"pdserve router: --discovery {args.discovery} needs --{role}-service")
    port = args.service_port or DEFAULT_PORTS[role]
    if args.discovery == "dns":
        host = service if "." in service else f"{service}.{args.namespace}.svc"
        return DnsDiscovery(host, port, interval=args.health_interval)
    return EndpointSliceDiscovery(args.namespace, service, port, api_url=args.k8s_api_url or None)


def build_app(args: argparse.Namespace) -> Any:
    """The app as ``pdserve router`` runs it (tests may call this too)."""
    from common.models import resolve_model  # light, but only needed here
    from router.app import create_app

    settings = settings_from_args(args)
    model_dir = resolve_model(args.model)
    processor = PromptProcessor.from_model_dir(
        model_dir, block_size=args.block_size, max_model_len=args.max_model_len
    )
    if os.path.isdir(os.path.expanduser(args.model)) and not args.served_model_name:
        settings.served_model_names = [args.model, os.path.basename(os.path.normpath(args.model))]
    tls = TlsFiles.load(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca)
    if args.grpc_tls_server_name and tls is None:
        raise ValueError("--grpc-tls-server-name needs mTLS (--grpc-tls-cert/-key/-ca)")
    metrics = RouterMetrics()
    pools = [
        InstancePool(
            role,
            make_discovery(args, role),
            policy=getattr(args, f"{role}_policy"),
            metrics=metrics,
            health_interval=args.health_interval,
            check_timeout=args.health_timeout,
            grpc_token=args.grpc_token,
            tls=tls,
            tls_server_name=args.grpc_tls_server_name,
        )
        for role in ("prefill", "decode")
    ]
    return create_app(settings, pools[0], pools[1], processor=processor, metrics=metrics)


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status."""
    import uvicorn

    try:
        app = build_app(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    logger.info("router listening on http://%s:%d (mode %s)", args.host, args.port, args.mode)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        access_log=False,
    )
    uvicorn.Server(config).run()
    return 0
