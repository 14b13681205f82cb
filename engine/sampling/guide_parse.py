"""A guide's text -> xgrammar ``Grammar`` (the parse, before any token-level compile).

Both the engine (to refuse a bad guide at once) and the compile children of the grammar
helper (engine/sampling/grammar_worker.py) parse with this.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.core.guided_spec import GuidedSpec

# xgrammar prefixes its C++ errors with a timestamp, a source location and an internal check.
_XGR_NOISE = re.compile(
    r"^\s*\[[0-9:]+\]\s*\S+\.(cc|h):\d+:\s*(Check failed: \(.*?\) is false:\s*)?"
)


def parser_message(exc: BaseException) -> str:
    """xgrammar's error text without the C++ location noise."""
    return _XGR_NOISE.sub("", str(exc)).strip() or type(exc).__name__


# xgrammar (0.2.9) writes a JSON string with a length bound (minLength/maxLength) as
# characters of this class, which leaves the control characters U+0000-U+001F other than
# CR/LF allowed raw; JSON forbids them unescaped (a sampled ESC inside a "maxLength" string
# made the output unparseable). Such classes are narrowed to JSON's own string characters.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_grammar(xgr: Any, schema: str, **options: Any) -> Any:
    """``Grammar.from_json_schema`` whose strings never hold a raw control character."""
    grammar = xgr.Grammar.from_json_schema(schema, **options)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def parse_guide(spec: GuidedSpec) -> Any:
    """The xgrammar ``Grammar`` of a guide; ValueError carrying the parser's message."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_object":
            # Any JSON object; additional properties allowed (strict mode would allow only {}).
            return _json_grammar(xgr, '{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            # Compact whitespace: free whitespace lets small models loop on spaces forever.
            return _json_grammar(xgr, spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            # JSON string literals are valid EBNF literals (same escapes).
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in spec.choices())
            )
        return xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid guided {spec.kind}: {parser_message(exc)}") from exc
