"""Flags of the engine services and the ``EngineConfig`` they build (docs/design.md §3).

Each engine flag is declared once, in ``ENGINE_FLAGS``: the services add all of them, and
``pdserve up`` adds the subset it forwards (``UP_ENGINE_FLAGS``) and passes the values on with
``forward_engine_flags``. Torch-free: the engine is imported only in ``engine_config_from_args``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from common.flags import (
    add_env_argument,
    add_env_switch,
    fraction,
    memory_size,
    non_negative_int,
    optional_int,
    positive_int,
)
from common.grpc_tls import add_tls_arguments

# The engine validates the value at startup (engine.spec_decode.config, not imported here:
# this module stays torch-free).
SPECULATIVE_HELP = (
    'speculative decoding: "ngram:k=4[,n=4,min_n=1]" or "draft:model=PATH,k=4"; unset = off'
)


# Every engine flag, declared once: (flag, add_env_argument keywords, forwarded by `up`).
# `pdserve up` adds the forwarded ones with no default of its own (None = the engine's), so
# only flags a user set travel to the services.
EngineFlag = tuple[str, dict[str, Any], bool]
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    (
        "--model",
        {"default": "smollm2", "help": "model name (see `pdserve models`) or local HF directory"},
        False,
    ),
    ("--device", {"default": "cpu", "choices": ["cpu", "cuda"], "help": "device"}, False),
    (
        "--dtype",
        {
            "default": "auto",
            "choices": ["auto", "float32", "bfloat16", "float16"],
            "help": "weights/KV dtype",
        },
        True,
    ),
    (
        "--kv-cache-dtype",
        {
            "default": "auto",
            "choices": ["auto", "fp8"],
            "help": "KV cache storage: auto = the model dtype, fp8 = float8 e4m3 (half the bytes)",
        },
        True,
    ),
    (
        "--load-format",
        {
            "default": "auto",
            "choices": ["auto", "dummy"],
            "help": "dummy = random weights, no files",
        },
        True,
    ),
    ("--block-size", {"type": positive_int, "default": 16, "help": "tokens per KV block"}, False),
    (
        "--max-num-seqs",
        {"type": positive_int, "default": 256, "help": "max running requests"},
        True,
    ),
    (
        "--max-num-batched-tokens",
        {"type": positive_int, "default": 2048, "help": "token budget per step"},
        True,
    ),
    (
        "--max-model-len",
        {"type": optional_int, "default": None, "help": "max prompt+output tokens"},
        True,
    ),
    (
        "--kv-cache-memory",
        {"type": memory_size, "default": None, "help": "KV cache size, e.g. 512Mi or 2GiB"},
        True,
    ),
    (
        "--gpu-memory-utilization",
        {"type": fraction, "default": 0.9, "help": "GPU memory fraction"},
        False,
    ),
    (
        "--attention-backend",
        {
            "default": None,
            "choices": ["auto", "torch_ref", "triton", "flash_attn"],
            "help": "attention kernels (engine default auto: Triton on CUDA, plus FA4 per "
            "step shape when flash-attn-4 is installed; docs/gpu.md)",
        },
        True,
    ),
    (
        "--quantization",
        {
            "default": None,
            "choices": ["fp8"],
            "help": "fp8 = e4m3 weights quantized at load (docs/quantization.md); unset = "
            "the checkpoint's own (an FP8 checkpoint loads as FP8 either way)",
        },
        True,
    ),
    ("--seed", {"type": int, "default": 0, "help": "engine seed"}, True),
    ("--speculative", {"default": None, "help": SPECULATIVE_HELP}, False),
    (
        "--tensor-parallel-size",
        {
            "type": positive_int,
            "default": 1,
            "help": "shard the model over this many processes (GPUs on CUDA)",
        },
        True,
    ),
    (
        "--torch-threads",
        {
            "type": non_negative_int,
            "default": 0,
            "help": "torch intra-op threads; 0 = torch's default",
        },
        False,
    ),
)
UP_ENGINE_FLAGS = tuple(flag for flag, _, forwarded in ENGINE_FLAGS if forwarded)


def add_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The engine's knobs (``EngineConfig``), shared by the prefill and decode services."""
    group = parser.add_argument_group("engine")
    for flag, options, _ in ENGINE_FLAGS:
        add_env_argument(group, flag, **options)
    add_env_switch(group, "--no-prefix-caching", help="disable the local prefix cache")


def add_forwarded_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The engine flags `pdserve up` forwards to every engine, each unset by default."""
    for flag, options, forwarded in ENGINE_FLAGS:
        if forwarded:
            add_env_argument(
                parser,
                flag,
                **{**options, "default": None, "help": "per engine: " + options["help"]},
            )


def forward_engine_flags(args: argparse.Namespace) -> list[str]:
    """The forwarded engine flags that are set in ``args``, as command-line words."""
    words: list[str] = []
    for flag in UP_ENGINE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            words += [flag, str(value)]
    return words


def add_service_arguments(parser: argparse.ArgumentParser | Any, *, role: str) -> None:
    """Flags of a gRPC engine service (``role`` is "prefill" or "decode")."""
    port, metrics_port = (50051, 9101) if role == "prefill" else (50052, 9102)
    group = parser.add_argument_group("service")
    add_env_argument(group, "--host", default="0.0.0.0", help="gRPC listen address")
    add_env_argument(group, "--port", type=non_negative_int, default=port, help="gRPC port")
    add_env_argument(
        group,
        "--metrics-port",
        type=non_negative_int,
        default=metrics_port,
        help="Prometheus /metrics port; 0 = off",
    )
    add_env_argument(
        group,
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    add_env_argument(
        group,
        "--max-waiting",
        type=non_negative_int,
        default=0,
        help="refuse (RESOURCE_EXHAUSTED) when this many requests wait; 0 = no limit",
    )
    add_env_argument(
        group,
        "--grpc-token",
        default="",
        help="require 'authorization: Bearer TOKEN' on every call but health checks "
        "(prefer the environment twin: a command line is visible to every user)",
    )
    add_tls_arguments(group, server=True)
    add_env_argument(
        group,
        "--grpc-allowed-clients",
        default="",
        help="with mTLS: only callers whose certificate names one of these (SAN DNS/IP or "
        "CN, comma-separated) may call; empty = any certificate the CA signed",
    )
    add_env_argument(
        group,
        "--grpc-health-port",
        type=non_negative_int,
        default=0,
        help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes that "
        "cannot do mTLS, e.g. the kubelet's); 0 = off",
    )
    if role == "decode":
        add_env_argument(
            group,
            "--kv-load-failure",
            default="recompute",
            choices=["recompute", "fail"],
            help="a KV block missing or corrupt in the store: recompute it locally or fail the request",
        )
    add_engine_arguments(parser)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """An ``engine.config.EngineConfig`` from parsed engine flags (imports the engine lazily).

    ``--model`` is resolved with :func:`common.models.resolve_model` (a known name is pulled
    into the cache on first use); unset optional knobs keep the engine's defaults.
    """
    from common.models import resolve_model
    from engine.config import EngineConfig

    kwargs: dict[str, Any] = {
        "model": resolve_model(args.model),
        "dtype": args.dtype,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", None) or "auto",
        "device": args.device,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if getattr(args, "speculative", None):
        kwargs["speculative"] = args.speculative
    if getattr(args, "quantization", None):
        kwargs["quantization"] = args.quantization
    if getattr(args, "kv_load_failure", None):
        kwargs["kv_load_failure"] = args.kv_load_failure
    return EngineConfig(**kwargs)


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """How one engine service process runs (the non-engine, non-store flags)."""

    role: str  # "prefill" | "decode"
    host: str
    port: int
    metrics_port: int
    drain_grace: float
    max_waiting: int
    torch_threads: int
    model_name: str
    grpc_token: str = ""  # empty: calls need no token (common/grpc_token.py)
    grpc_tls_cert: str = ""  # the three together or none: mTLS (common/grpc_tls.py)
    grpc_tls_key: str = ""
    grpc_tls_ca: str = ""
    grpc_allowed_clients: str = ""  # with mTLS: allowed certificate names, comma-separated
    grpc_health_port: int = 0  # plaintext health-only port for probes; 0 = off

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str) -> ServiceSettings:
        """Settings from a namespace parsed with ``add_service_arguments``."""
        return cls(
            role,
            args.host,
            args.port,
            args.metrics_port,
            args.drain_grace,
            args.max_waiting,
            args.torch_threads,
            args.model,
            args.grpc_token,
            args.grpc_tls_cert,
            args.grpc_tls_key,
            args.grpc_tls_ca,
            args.grpc_allowed_clients,
            args.grpc_health_port,
        )
