"""Guided-decoding request fields → the wire guide ``(guided_kind, guided_value)``.

The router only shapes the guide (torch- and xgrammar-free): whether a schema, regex or
grammar actually parses is checked by the engine behind the prefill leg, whose
INVALID_ARGUMENT comes back to the client as a 400 with the parser's message.

Accepted (at most one per request): vLLM's ``guided_regex``, ``guided_choice``,
``guided_grammar``, ``guided_json`` extensions, their newer form ``structured_outputs``
(one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), and OpenAI's
``response_format`` (``text`` = no guide, ``json_object``, ``json_schema`` with a ``schema``).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

NO_GUIDE = ("", "")


class GuidedFields(Protocol):
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None
    guided_json: dict[str, Any] | str | None
    response_format: dict[str, Any] | None
    structured_outputs: dict[str, Any] | None


def guide_of(req: GuidedFields) -> tuple[str, str]:
    """``(kind, value)`` of the request's guide, ``("", "")`` for none.

    Raises ValueError (a 400 at the HTTP edge) when more than one guide is given or one is
    malformed in shape (empty regex, empty choice list, ``json_schema`` without a schema).
    """
    fields = (
        ("guided_regex", req.guided_regex, _regex),
        ("guided_choice", req.guided_choice, _choice),
        ("guided_grammar", req.guided_grammar, _grammar),
        ("guided_json", req.guided_json, _json_schema),
    )
    guides = [build(value, name) for name, value, build in fields if value is not None]
    fmt = _response_format_guide(req.response_format)
    if fmt != NO_GUIDE:
        guides.append(fmt)
    guides += _structured_guides(req.structured_outputs)
    if len(guides) > 1:
        raise ValueError(
            "give at most one of guided_regex, guided_choice, guided_grammar, guided_json, "
            "a structured_outputs kind and a non-text response_format"
        )
    return guides[0] if guides else NO_GUIDE


def _regex(value: Any, name: str) -> tuple[str, str]:
    return ("regex", _non_empty(value, name))


def _grammar(value: Any, name: str) -> tuple[str, str]:
    return ("grammar", _non_empty(value, name))


def _json_schema(value: Any, name: str) -> tuple[str, str]:
    return ("json_schema", _schema_text(value, name))


def _choice(value: Any, name: str) -> tuple[str, str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):  # fmt: skip
        raise ValueError(f"{name} must be a non-empty list of non-empty strings")
    return ("choice", json.dumps(value))


# vLLM's ``structured_outputs``: its keys as the ``guided_*`` fields read them, and
# ``json_object``. Its other keys tune a backend's grammar (whitespace, fallbacks) and
# would change the output silently if ignored, so they are refused.
STRUCTURED_KINDS = {"json": _json_schema, "regex": _regex, "choice": _choice, "grammar": _grammar}


def _response_format_guide(fmt: dict[str, Any] | None) -> tuple[str, str]:
    if not fmt:
        return NO_GUIDE
    kind = fmt.get("type", "text")
    if kind == "text":
        return NO_GUIDE
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise ValueError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
            )
        return ("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _structured_guides(spec: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The guides of vLLM's ``structured_outputs`` object (several: refused by the caller)."""
    if spec is None:
        return []
    kinds = (*STRUCTURED_KINDS, "json_object")
    unknown = sorted(k for k, v in spec.items() if k not in kinds and v not in (None, False))
    if unknown:
        raise ValueError(
            f"structured_outputs.{unknown[0]} is not supported; give one of " + ", ".join(kinds)
        )
    guides = [
        build(spec[key], f"structured_outputs.{key}")
        for key, build in STRUCTURED_KINDS.items()
        if spec.get(key) is not None
    ]
    if spec.get("json_object") is True:
        guides.append(("json_object", ""))
    if not guides:
        raise ValueError("structured_outputs needs one of " + ", ".join(kinds))
    return guides


def _schema_text(schema: Any, name: str) -> str:
    """A schema as JSON text with sorted keys (equal schemas share one compiled grammar)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"{name} nests too deep") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{name} must be a JSON object (a JSON Schema)")
    _local_refs_only(schema, name)
    return json.dumps(schema, sort_keys=True)


def _local_refs_only(schema: dict[str, Any], name: str) -> None:
    """ValueError for a ``$ref`` that is not local (``#...``): an ``http://`` or
    ``file://`` reference would have a grammar compiler fetch or read it (as OpenAI,
    only references within the schema are served)."""
    stack: list[Any] = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(
                    f"{name}: $ref {ref[:100]!r} is not supported; only references within "
                    "the schema (#/...) are"
                )
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _non_empty(text: Any, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string")
    if not text.strip():
        raise ValueError(f"{name} must not be empty")
    return text
