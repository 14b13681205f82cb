"""Guided decoding end to end in the engine: every output obeys its guide, free requests
in the same batch are untouched, bad guides fail at add_request, and a request resumed
with tokens generated elsewhere (the first token from prefill) continues its grammar.

The tiny random model has SmolLM2's tokenizer, so its grammar masks are the real ones; it
is a harsh test (it has no wish to produce JSON) and runs fast. SmolLM2 runs check real
text on fewer seeds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.core.guided_spec import GuidedSpec
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
}
REGEX = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,5})?"
CHOICES = ["red", "green", "blue", 'say "hi"']
# Balanced parentheses around a digit: the grammar is recursive, a regex could not say it.
GRAMMAR = 'root ::= "(" root ")" | [0-9]'


def _check(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        depth = len(text) - len(text.lstrip("("))
        assert text == "(" * depth + text[depth] + ")" * depth and text[depth].isdigit(), text


SPECS = {
    "json_schema": GuidedSpec.json_schema(SCHEMA),
    "json_object": GuidedSpec("json_object"),
    "regex": GuidedSpec("regex", REGEX),
    "choice": GuidedSpec.choice(CHOICES),
    "grammar": GuidedSpec("grammar", GRAMMAR),
}


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _text(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice", "grammar"])
def test_tiny_model_outputs_obey_guide(tiny_model_dir: Path, kind: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512))
    n = 16
    for i in range(n):
        params = SamplingParams(max_tokens=96, temperature=1.0, seed=i, guided=SPECS[kind])
        engine.add_request(f"g{i}", [1, 504, 9826, 28, 198], params)
    outs = _drain(engine)
    assert len(outs) == n
    for i in range(n):
        assert outs[f"g{i}"][-1].finish_reason == "stop", (kind, _text(outs[f"g{i}"]))
        _check(kind, _text(outs[f"g{i}"]))
    assert not engine.guided._states, "matchers must be released when requests finish"


@pytest.mark.parametrize("speculative", [None, "ngram:k=3"])
def test_mixed_batch_leaves_free_requests_unchanged(
    tiny_model_dir: Path, speculative: str | None
) -> None:
    free_prompts = [[1, 2, 3, 4, 5] * 3, [900, 901, 902], [77] * 9, list(range(10, 40))]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(with_guided: bool) -> dict[str, list[int]]:
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, speculative=speculative)
        )
        for i, prompt in enumerate(free_prompts):
            if with_guided:  # interleave constrained requests, greedy and sampled
                kind = list(SPECS)[i % len(SPECS)]
                params = SamplingParams(
                    max_tokens=64, temperature=0.0 if i % 2 else 0.9, seed=i, guided=SPECS[kind]
                )
                engine.add_request(f"g{i}", prompt[::-1], params)
            engine.add_request(f"f{i}", prompt, greedy)
        outs = _drain(engine)
        return {
            rid: [t for o in v for t in o.new_token_ids]
            for rid, v in outs.items()
            if rid.startswith("f")
        }

    assert run(with_guided=True) == run(with_guided=False)


def test_bad_guides_fail_at_add_request(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    cases = [
        (GuidedSpec("regex", "[a-"), "invalid guided regex"),
        (
            GuidedSpec(
                "json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'
            ),
            "nope",
        ),
        (GuidedSpec("grammar", 'root ::= "a" undefined_rule'), "invalid guided grammar"),
    ]
    for i, (spec, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad{i}", [1, 2, 3], SamplingParams(guided=spec))
    assert not engine.has_unfinished() and not engine.scheduler.requests


def test_first_token_from_prefill_continues_the_grammar(tiny_model_dir: Path) -> None:
    """Decode side: the request arrives with the token prefill sampled under the same guide;
    the matcher must start after it. A token the guide forbids fails the request."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    tok = engine.tokenizer
    first = tok.encode("gre")[0]
    assert tok.decode([first]) in ("g", "gr", "gre")
    spec = GuidedSpec.choice(["green", "grey", "blue"])
    prompt = [1, 504, 9826]
    engine.add_request(
        "resume",
        prompt,
        SamplingParams(max_tokens=8, temperature=0.0, guided=spec),
        output_token_ids=[first],
    )
    bad_first = tok.encode("blue")[0] + 1  # a token no choice starts with
    engine.add_request(
        "bad", prompt, SamplingParams(max_tokens=8, guided=spec), output_token_ids=[bad_first]
    )
    outs = _drain(engine)
    full = tok.decode([first]) + _text(outs["resume"])
    assert full in ("green", "grey") and outs["resume"][-1].finish_reason == "stop", full
    assert outs["bad"][-1].finish_reason == "abort" and "not allowed by its guide" in (
        outs["bad"][-1].error or ""
    )


def test_grammar_termination_stops_even_with_ignore_eos(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, guided=SPECS["choice"])
    engine.add_request("c", [1, 2, 3], params)
    outs = _drain(engine)["c"]
    assert outs[-1].finish_reason == "stop" and _text(outs) in CHOICES


def test_abort_while_grammar_compiles(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    spec = GuidedSpec.json_schema(
        {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    )
    engine.add_request("a", [1, 2, 3], SamplingParams(guided=spec))
    assert engine.get_load().waiting == 1
    assert engine.abort_request("a")
    outs = _drain(engine)
    assert outs["a"][-1].finish_reason == "abort"
    assert not engine.guided.has_pending() and not engine.scheduler.requests


@pytest.mark.slow
def test_smollm2_seeded_runs_obey_guides(smollm2_dir: Path) -> None:
    """Real text: several seeded sampled runs per guide kind, all in one batch."""
    from engine.llm import LLM

    llm = LLM(str(smollm2_dir), num_kv_blocks=256)
    cat = "Reply with a JSON object with the keys name and color for a cat."
    runs = [  # (kind, question, temperature, seeds)
        ("json_schema", "Describe a user account as JSON with name, age and role.", 0.8, range(4)),
        ("regex", "Invent a product code.", 0.8, range(4)),
        ("choice", "What colour is the sky?", 0.8, range(4)),
        ("grammar", "Write a digit in parentheses.", 0.8, range(2)),
        # json_object is unbounded (any object): a small model can ramble in an array until
        # max_tokens; a plain question and a frequency penalty keep it short.
        ("json_object", cat, 0.5, range(1, 3)),
        ("json_object", cat.replace("cat", "dog"), 0.0, range(1)),
    ]
    prompts, params, kinds = [], [], []
    for kind, question, temperature, seeds in runs:
        chat = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for seed in seeds:
            prompts.append(chat)
            params.append(
                SamplingParams(
                    max_tokens=96,
                    temperature=temperature,
                    seed=seed,
                    frequency_penalty=0.5 if kind == "json_object" else 0.0,
                    guided=SPECS[kind],
                )
            )
            kinds.append(kind)
    outputs = llm.generate(prompts, params)
    for kind, out in zip(kinds, outputs, strict=True):
        assert out.finish_reason == "stop", (kind, out.text)
        _check(kind, out.text)
