"""Command-line settings shared by the components, each flag with a ``PDSERVE_*`` twin.

Every flag ``--some-flag`` reads its default from the environment variable
``PDSERVE_SOME_FLAG`` (what a Kubernetes pod spec sets); an explicit flag wins over the
environment, which wins over the built-in default. argparse converts and validates string
defaults exactly like typed-in values, so a bad environment value fails with the same clear
message as a bad flag.

This module is torch-free: `pdserve router` and `pdserve up` import it.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

ENV_PREFIX = "PDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT])?(?:I?B)?", re.IGNORECASE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def env_name(flag: str) -> str:
    """``--kv-load-failure`` → ``PDSERVE_KV_LOAD_FAILURE``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    """Parse an environment boolean; raises ValueError on anything but the usual spellings."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no), got {text!r}")


def add_env_argument(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    type: Callable[[str], Any] = str,  # noqa: A002 - mirrors argparse
    default: Any = None,
    help: str = "",  # noqa: A002 - mirrors argparse
    choices: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add a valued flag whose default comes from its ``PDSERVE_*`` twin when set.

    argparse converts a string default with ``type`` when the (sub)command is parsed, so a
    bad environment value fails then, with the flag's name, like a bad flag would; it does
    not check ``choices`` for defaults, so ``type`` is wrapped to do that too.
    """
    env = os.environ if environ is None else environ
    name = env_name(flag)
    value: Any = env.get(name, default)
    convert = type if choices is None else _checked_choice(type, choices, name)
    suffix = f" (env {name}; default {default})"
    parser.add_argument(flag, type=convert, default=value, choices=choices, help=help + suffix)


def _checked_choice(
    convert: Callable[[str], Any], choices: list[str], name: str
) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        value = convert(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (flag or {name}); choose from {', '.join(map(str, choices))}"
            )
        return value

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def add_env_switch(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    help: str = "",  # noqa: A002 - mirrors argparse
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add a ``store_true`` flag that the environment can also turn on (``PDSERVE_X=1``)."""
    env = os.environ if environ is None else environ
    name = env_name(flag)
    raw = env.get(name)
    try:
        default = parse_bool(raw) if raw is not None else False
    except ValueError as exc:
        raise SystemExit(f"pdserve: bad {name}: {exc}") from None
    parser.add_argument(flag, action="store_true", default=default, help=f"{help} (env {name})")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def optional_int(text: str) -> int | None:
    """argparse type: an integer, or empty / ``none`` / ``auto`` for "let the engine decide"."""
    if text.strip().lower() in {"", "none", "auto"}:
        return None
    return int(text)


def memory_size(text: str) -> int | None:
    """argparse type: bytes, optionally with a K/M/G/T suffix (``512M``, ``2GiB``); empty or
    ``auto`` → None (let the engine size the KV cache itself)."""
    raw = text.strip()
    if raw.lower() in {"", "none", "auto"}:
        return None
    match = _SIZE.fullmatch(raw)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 2GiB, got {text!r}")
    scale = _UNITS[match.group(2).upper()] if match.group(2) else 1
    value = int(float(match.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def fair_thread_share(num_engine_processes: int, cores: int | None = None) -> int:
    """Torch threads per engine process: the machine's usable cores split evenly, at least 1.

    On a small machine oversubscription (each process grabbing every core) costs more than it
    gives, so processes share rather than compete.
    """
    if cores is None:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    return max(1, cores // max(1, num_engine_processes))


# The engine validates the value at startup (engine.spec_decode.config, not imported here:
# this module stays torch-free).
SPECULATIVE_HELP = (
    'speculative decoding: "ngram:k=4[,n=4,min_n=1]" or "draft:model=PATH,k=4"; unset = off'
)


def add_engine_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The engine's knobs (``EngineConfig``), shared by the prefill and decode services."""
    group = parser.add_argument_group("engine")
    add_env_argument(
        group,
        "--model",
        default="smollm2",
        help="model name (see `pdserve models`) or local HF directory",
    )
    add_env_argument(group, "--device", default="cpu", choices=["cpu", "cuda"], help="device")
    add_env_argument(
        group,
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights/KV dtype",
    )
    add_env_argument(
        group,
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy = random weights, no files",
    )
    add_env_argument(
        group, "--block-size", type=positive_int, default=16, help="tokens per KV block"
    )
    add_env_argument(
        group, "--max-num-seqs", type=positive_int, default=256, help="max running requests"
    )
    add_env_argument(
        group,
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="token budget per step",
    )
    add_env_argument(
        group, "--max-model-len", type=optional_int, default=None, help="max prompt+output tokens"
    )
    add_env_argument(
        group, "--kv-cache-memory", type=memory_size, default=None, help="KV cache size, e.g. 512M"
    )
    add_env_argument(
        group, "--gpu-memory-utilization", type=fraction, default=0.9, help="GPU memory fraction"
    )
    add_env_switch(group, "--no-prefix-caching", help="disable the local prefix cache")
    add_env_argument(
        group,
        "--attention-backend",
        default=None,
        help="attention backend (engine default if unset)",
    )
    add_env_argument(group, "--seed", type=int, default=0, help="engine seed")
    add_env_argument(
        group,
        "--speculative",
        default=None,
        help=SPECULATIVE_HELP,
    )
    add_env_argument(
        group,
        "--torch-threads",
        type=non_negative_int,
        default=0,
        help="torch intra-op threads; 0 = torch's default",
    )


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

    ``--model`` is resolved with :func:`pdserve.models.resolve_model` (a known name is pulled
    into the cache on first use); unset optional knobs keep the engine's defaults.
    """
    from engine.config import EngineConfig
    from pdserve.models import resolve_model

    kwargs: dict[str, Any] = {
        "model": resolve_model(args.model),
        "dtype": args.dtype,
        "device": args.device,
        "load_format": args.load_format,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
    }
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if getattr(args, "speculative", None):
        kwargs["speculative"] = args.speculative
    if getattr(args, "kv_load_failure", None):
        kwargs["kv_load_failure"] = args.kv_load_failure
    return EngineConfig(**kwargs)
