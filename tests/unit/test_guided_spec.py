"""GuidedSpec validation and the parser errors surfaced at add_request."""

from __future__ import annotations

import json

import pytest

from engine.core.guided_spec import GuidedSpec
from engine.core.sampling_params import SamplingParams
from engine.sampling.guided import parse_guide, parser_message


def test_spec_shapes() -> None:
    assert GuidedSpec.json_schema({"b": 1, "a": 2}) == GuidedSpec("json_schema", '{"a": 2, "b": 1}')
    spec = GuidedSpec.choice(["yes", 'say "no"'])
    assert spec.choices() == ["yes", 'say "no"']
    assert hash(spec) == hash(GuidedSpec.choice(["yes", 'say "no"']))  # cache key
    assert SamplingParams(guided=GuidedSpec("json_object")).guided == GuidedSpec("json_object", "")


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("xml", "", "guided kind must be one of"),
        ("regex", "  ", "guided regex must not be empty"),
        ("json_schema", "{not json", "guided json_schema is not valid JSON"),
        ("choice", "[]", "non-empty list of non-empty strings"),
        ("choice", '["a", 3]', "non-empty list of non-empty strings"),
        ("choice", "a,b", "guided choice is not valid JSON"),
    ],
)
def test_spec_errors(kind: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GuidedSpec(kind, value)


def test_sampling_params_rejects_non_spec() -> None:
    with pytest.raises(ValueError, match="guided must be a GuidedSpec"):
        SamplingParams(guided={"kind": "regex"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec, message",
    [
        (GuidedSpec("regex", "(abc"), "invalid guided regex: Regex parsing error at position 5"),
        (
            GuidedSpec("json_schema", '{"type": "foo"}'),
            'invalid guided json_schema: Unsupported type "foo"',
        ),
        (GuidedSpec("json_schema", "[1, 2]"), "Schema should be an object or bool"),
        (GuidedSpec("grammar", "root ::= "), "invalid guided grammar: EBNF parser error at line 1"),
        (GuidedSpec("grammar", 'start ::= "a"'), "invalid guided grammar"),
    ],
)
def test_parser_errors_carry_the_parser_message(spec: GuidedSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_guide(spec)
    assert ".cc:" not in str(info.value)  # the C++ location noise is stripped


def test_valid_guides_parse() -> None:
    for spec in (
        GuidedSpec("json_object"),
        GuidedSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        GuidedSpec("regex", r"\d{3}-[a-z]+"),
        GuidedSpec.choice(['a"b', "café", "x\\y\n"]),
        GuidedSpec("grammar", 'root ::= "(" root ")" | ""'),
    ):
        assert parse_guide(spec) is not None


def test_parser_message_strips_location() -> None:
    raw = RuntimeError(
        "[14:39:53] /project/cpp/x.cc:94: Check failed: (error.empty()) is false: boom"
    )
    assert parser_message(raw) == "boom"
    assert json.dumps(parser_message(RuntimeError("plain"))) == '"plain"'


@pytest.mark.parametrize("bound", [{"maxLength": 4}, {"minLength": 1}, {}])
def test_json_strings_never_take_a_raw_control_character(bound: dict[str, int]) -> None:
    """JSON forbids U+0000-U+001F unescaped in a string. xgrammar's rule for a string with a
    length bound allowed them (a sampled ESC made the output unparseable); parse_guide
    narrows it. Checked with a matcher over a byte vocabulary: inside the string, "a" is
    taken and ESC, TAB and NUL are not."""
    import xgrammar as xgr

    vocab = ['{"n": "', "a", "\x1b", "\t", "\x00", '"}']
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW)
    schema = {"type": "object", "properties": {"n": {"type": "string", **bound}}, "required": ["n"]}
    compiled = xgr.GrammarCompiler(info).compile_grammar(
        parse_guide(GuidedSpec.json_schema(schema))
    )
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(0)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    allowed = {vocab[t] for t in range(len(vocab)) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert "a" in allowed
    assert not allowed & {"\x1b", "\t", "\x00"}, allowed
