"""Tool-call parsers, selected with ``--tool-call-parser`` (vLLM's names), and the
streaming state that turns a choice's text into ``tool_calls`` deltas.

docs/design.md §3 "Tool calls" has the contract; docs/running.md the flags.
"""

from __future__ import annotations

from router.tools.parsers.base import CallPart, Parsed, ToolParser
from router.tools.parsers.hermes import HermesParser
from router.tools.parsers.llama3_json import Llama3JsonParser
from router.tools.parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)
}


def parser_class(name: str) -> type[ToolParser]:
    """The parser registered as ``name``; ValueError naming the choices otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
        ) from None


__all__ = ["PARSERS", "CallPart", "Parsed", "ToolParser", "parser_class"]
