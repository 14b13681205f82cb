"""The engine services' settings (docs/design.md §3 "Settings"): ``ServiceSettings``, the
service's own flags, beside ``engine.args.EngineArgs`` (the engine's) and
``kv_store.args.KVStoreSettings`` (the connector's). Each is one typed model; the flags,
their ``PDSERVE_*`` twins and `pdserve up`'s forwarding are derived from them, and the
functions below are the services' (and tests') ways in. Torch-free: the engine is imported
only when ``engine_config_from_args`` builds the ``EngineConfig``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from common.flags import byte_size, non_negative_int
from common.settings import ArgsModel, forwarded_words, setting
from common.tracing import ENDPOINT_HELP
from engine.args import SPECULATIVE_HELP, EngineArgs

__all__ = [
    "SPECULATIVE_HELP",
    "ServiceSettings",
    "add_forwarded_engine_arguments",
    "add_service_arguments",
    "engine_config_from_args",
    "forward_engine_flags",
]

# gRPC and metrics ports by role: both services can run on one machine with no flags.
_PORTS = {
    "prefill": {"port": 50051, "metrics_port": 9101},
    "decode": {"port": 50052, "metrics_port": 9102},
}


@dataclass(frozen=True)
class ServiceSettings(ArgsModel):
    """How one engine service process runs (the non-engine, non-store flags; group
    "service"). ``role``, ``torch_threads`` and ``model_name`` come from outside the
    group (``from_args`` fills them from the engine's flags)."""

    GROUP = "service"

    role: str = ""  # "prefill" | "decode"
    host: str = setting("0.0.0.0", help="gRPC listen address")
    port: int = setting(50051, type=non_negative_int, help="gRPC port")
    metrics_port: int = setting(
        9101, type=non_negative_int, help="Prometheus /metrics port; 0 = off"
    )
    drain_grace: float = setting(
        30.0, type=float, unit="s", help="seconds in-flight requests get after SIGTERM"
    )
    max_waiting: int = setting(
        0,
        type=non_negative_int,
        help="refuse (RESOURCE_EXHAUSTED) when this many requests wait; 0 = no limit",
    )
    # empty: calls need no token (common/grpc_token.py)
    grpc_token: str = setting(
        "",
        repr=False,
        help="require 'authorization: Bearer TOKEN' on every call but health checks "
        "(prefer the environment twin: a command line is visible to every user)",
    )
    # the three together or none: mTLS (common/grpc_tls.py)
    grpc_tls_cert: str = setting("", help="PEM: this service's certificate (chain)")
    grpc_tls_key: str = setting("", help="PEM: this service's private key")
    grpc_tls_ca: str = setting("", help="PEM: the CA that signs callers' certificates")
    grpc_allowed_clients: str = setting(
        "",
        help="with mTLS: only callers whose certificate names one of these (SAN DNS/IP or "
        "CN, comma-separated) may call; empty = any certificate the CA signed",
        helm="grpcTls.allowedClients",
    )
    grpc_health_port: int = setting(
        0,
        type=non_negative_int,
        help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes that "
        "cannot do mTLS, e.g. the kubelet's); 0 = off",
        helm="grpcTls.healthPort",
    )
    grpc_max_message_bytes: int = setting(
        8 << 20,
        type=byte_size,
        unit="bytes",
        help="largest request message accepted (RESOURCE_EXHAUSTED beyond it, before any "
        "parsing); 8Mi holds a 128k-token Decode with its handle and a 4 MiB grammar",
    )
    memory_trim_interval: float = setting(
        2.0,
        type=float,
        unit="s",
        help="this often, give freed heap memory back to the OS once the process grew by "
        "64 MiB (glibc malloc_trim; the buffers of refused oversized messages stay "
        "otherwise); 0 = off",
    )
    otlp_traces_endpoint: str = setting("", help=ENDPOINT_HELP, helm="tracing.otlpTracesEndpoint")
    torch_threads: int = 0
    model_name: str = ""

    @classmethod
    def for_role(cls, args: argparse.Namespace, role: str) -> ServiceSettings:
        """Settings from a namespace parsed with ``add_service_arguments``."""
        return cls.from_args(
            args, role=role, torch_threads=args.torch_threads, model_name=args.model
        )

    def validate(self) -> None:
        if self.role not in _PORTS:
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")


def add_service_arguments(parser: argparse.ArgumentParser | Any, *, role: str) -> None:
    """Flags of a gRPC engine service (``role`` is "prefill" or "decode"): the service's
    own, then the engine's (the connector's are ``kv_store.args.add_cli_arguments``)."""
    ServiceSettings.add_arguments(parser, defaults=_PORTS[role])
    EngineArgs.add_arguments(parser, role=role)


def add_forwarded_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The engine flags `pdserve up` forwards to every engine, each unset by default."""
    for s in EngineArgs.forwarded():
        s.add_to(parser)


def forward_engine_flags(args: argparse.Namespace) -> list[str]:
    """The forwarded engine flags that are set in ``args``, as command-line words."""
    return forwarded_words(EngineArgs.forwarded(), args)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """An ``engine.config.EngineConfig`` from parsed engine flags (imports the engine lazily)."""
    return EngineArgs.from_args(args).create_engine_config()
