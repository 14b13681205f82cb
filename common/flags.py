"""Command-line settings shared by the components, each flag with a ``PDSERVE_*`` twin.

Every flag ``--some-flag`` reads its default from the environment variable
``PDSERVE_SOME_FLAG`` (what a Kubernetes pod spec sets); an explicit flag wins over the
environment, which wins over the built-in default. argparse converts and validates string
defaults exactly like typed-in values, so a bad environment value fails with the same clear
message as a bad flag.

This module is torch-free and imports nothing outside `common`: the router, the services and the CLI
all build their flags with it. Sizes follow one rule (``common.sizes``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from common.sizes import parse_bytes

ENV_PREFIX = "PDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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


def on_off(text: str) -> bool:
    """argparse type of a boolean flag that takes a value (``--x on|off``), for an engine
    setting whose default may be either: a switch could only turn it on."""
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_env_argument(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    type: Callable[[str], Any] = str,  # noqa: A002 - mirrors argparse
    default: Any = None,
    help: str = "",  # noqa: A002 - mirrors argparse
    choices: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    unit: str = "",
    aliases: tuple[str, ...] = (),
) -> None:
    """Add a valued flag whose default comes from its ``PDSERVE_*`` twin when set
    (``aliases``: other spellings of the flag, e.g. vLLM's ``-pp``).

    argparse converts a string default with ``type`` when the (sub)command is parsed, so a
    bad environment value fails then, with the flag's name, like a bad flag would; it does
    not check ``choices`` for defaults, so ``type`` is wrapped to do that too.
    """
    env = os.environ if environ is None else environ
    name = env_name(flag)
    value: Any = env.get(name, default)
    convert = type if choices is None else _checked_choice(type, choices, name)
    shown = f"{default} {unit}" if unit and default is not None else f"{default}"
    suffix = f" (env {name}; default {shown})"
    parser.add_argument(
        flag, *aliases, type=convert, default=value, choices=choices, help=help + suffix
    )


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
    """argparse type: a byte size (``common.sizes``: ``512Mi``, ``2GiB``, ``10G`` = 10**10);
    empty or ``auto`` → None (let the engine size the KV cache itself)."""
    raw = text.strip()
    if raw.lower() in {"", "none", "auto"}:
        return None
    try:
        value = parse_bytes(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """argparse type: a byte size >= 0 (``common.sizes``)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
