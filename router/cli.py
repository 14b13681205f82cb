"""``pdserve router``: flags (each with a ``PDSERVE_*`` env twin) and the process entry.

``add_router_arguments(parser)`` adds the flags (declared once, in ``router/args.py``);
``run_router(args)`` builds the tokenizer, discovery, pools and app, and serves until
SIGINT/SIGTERM. Torch-free.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from typing import Any

from common.grpc_tls import TlsFiles
from router.args import RouterArgs
from router.discovery import (
    DnsDiscovery,
    EndpointSliceDiscovery,
    InstanceDiscovery,
    StaticDiscovery,
)
from router.discovery.file import FileDiscovery
from router.http_deadline import header_deadline_protocol
from router.metrics import RouterMetrics
from router.routing.kv_index import TierWeights
from router.routing.pool import InstancePool
from router.settings import RouterSettings
from router.tokenizer import PromptProcessor

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"prefill": 50051, "decode": 50052}


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_router_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Every router flag (``router.args.RouterArgs``); defaults come from ``PDSERVE_<FLAG>``."""
    RouterArgs.add_arguments(parser)


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
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser or None,
        max_batch_prompts=args.max_batch_prompts,
        max_chat_messages=args.max_chat_messages,
        body_read_timeout=args.body_read_timeout,
        header_read_timeout=args.header_read_timeout,
        max_connections=args.max_connections,
        preprocess_concurrency=args.preprocess_concurrency,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        decode_first=args.decode_first == "full",
        max_local_prefill_tokens=args.max_local_prefill_tokens,
    )


def make_discovery(args: argparse.Namespace, role: str) -> InstanceDiscovery:
    """The instance source of pool ``role`` ("prefill" or "decode") per ``--discovery``."""
    if args.discovery == "static":
        return StaticDiscovery(getattr(args, f"{role}_urls"))
    if args.discovery == "file":
        if not args.instances_file:
            raise SystemExit("pdserve router: --discovery file needs --instances-file")
        try:
            return FileDiscovery(args.instances_file, role)
        except ValueError as exc:
            raise SystemExit(f"pdserve router: {exc}") from None
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
    weights = TierWeights(
        args.prefix_weight_device, args.prefix_weight_host, args.prefix_weight_store
    )
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
            kv_events=args.prefix_index == "events",
            kv_index_max_entries=args.kv_index_max_entries,
            kv_pending_window=args.kv_pending_window,
            tier_weights=weights,
            prefix_load_weight=args.prefix_load_weight,
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
    # The tokenizer, the app and the libraries are built now and live as long as the process:
    # move them out of the collector's generations, so a burst of requests (whose garbage
    # triggers full collections) does not pay for scanning them each time; vLLM's API server
    # does the same. Measured: docs/router.md "Garbage collection".
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        access_log=False,
        # Bounded connections (docs/router.md "Input limits"): idle keep-alive 5 s, at most
        # --max-connections (503 beyond), headers within --header-read-timeout.
        timeout_keep_alive=5,
        limit_concurrency=args.max_connections,
        http=header_deadline_protocol(args.header_read_timeout),
    )
    uvicorn.Server(config).run()
    return 0
