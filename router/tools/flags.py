"""The check of vLLM's tool-calling flags (declared in ``router/args.py``), shared by
``pdserve router`` and ``pdserve up`` (which passes them on to its router). Torch- and
server-free, so the launcher can import it cheaply."""

from __future__ import annotations

from typing import Any


def check_tool_flags(args: Any) -> None:
    """ValueError for ``--enable-auto-tool-choice`` without a parser (before anything starts)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
