"""The guide a request is constrained by: a kind and a string value.

Kept free of torch and xgrammar so the router and the services can build, validate the
shape of and pass through a guide without loading either. Whether the value actually
parses (schema, regex, grammar) is checked by the engine at ``add_request``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# json_object: any JSON object (value ignored, ""); json_schema: a JSON Schema as JSON text;
# regex: the whole output must match; choice: a JSON array of strings, the output is one of
# them; grammar: an EBNF grammar (xgrammar / GBNF dialect) with a ``root`` rule.
GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """A guide: ``kind`` (one of ``GUIDED_KINDS``) and its ``value``, both strings so the
    guide crosses gRPC as two string fields. Hashable: the engine caches compiled grammars
    by ``(kind, value)``. Use the ``choice`` / ``json_schema`` constructors for non-strings."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"guided value must be a string, got {type(self.value).__name__}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.value.strip():
            raise ValueError(f"guided {self.kind} must not be empty")
        if self.kind == "json_schema":
            _parse_json(self.value, "guided json_schema")
        if self.kind == "choice":
            self.choices()  # validates

    @classmethod
    def json_schema(cls, schema: dict[str, object] | str) -> GuidedSpec:
        """From a schema dict or JSON text (dicts are serialised with sorted keys, so equal
        schemas share one cache entry)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GuidedSpec:
        return cls("choice", json.dumps(list(choices)))

    def choices(self) -> list[str]:
        """The alternatives of a ``choice`` guide (ValueError if malformed)."""
        items = _parse_json(self.value, "guided choice")
        if (
            not isinstance(items, list)
            or not items
            or not all(isinstance(c, str) and c for c in items)
        ):
            raise ValueError("guided choice must be a non-empty list of non-empty strings")
        return items


def _parse_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc
