"""Guided and speculative decoding through the router end to end: real prefill + decode
processes (one decode with ``--speculative ngram:k=4``), router processes, the official
``openai`` client. Tiny random Llama (SmolLM2 tokenizer), fs KV store, few tokens."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.e2e.router_support import complete as support_complete
from tests.e2e.router_support import metric, openai_client, scrape
from tests.service_fixtures import ProcessStack, ServiceProcess
from tests.unit.test_launcher_gpus import flag, plan

PROMPT = "The quick brown fox jumps over the lazy dog because"


@dataclass
class Stack:
    router: ServiceProcess  # prefill + plain decode
    spec_router: ServiceProcess  # the same prefill + a speculative decode
    spec_decode: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess

    def client(self, router: ServiceProcess | None = None) -> openai.OpenAI:
        return openai_client((router or self.router).url)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("router_guided")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    # The engines share compiled grammars (engine/sampling/grammar_share.py).
    conn = ("--connector", "fs", "--kv-path", str(kv), "--guided-cache-dir", str(root / "g"))
    common = ["--served-model-name", "tiny", "--max-prompt-tokens", "256"]
    try:
        prefill, decode, spec_decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
            lambda: procs.service(
                "decode",
                connector_args=conn,
                extra_args=["--speculative", "ngram:k=4"],
                name="decode-spec",
            ),
        )
        router, spec_router = procs.together(
            lambda: procs.router(prefill=[prefill], decode=[decode], extra_args=common),
            lambda: procs.router(prefill=[prefill], decode=[spec_decode], extra_args=common),
        )
        yield Stack(router, spec_router, spec_decode, prefill, decode)
    finally:
        procs.close()


def complete(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    return support_complete(client, **({"prompt": PROMPT, "max_tokens": 8} | kwargs))


def test_guided_choice(stack: Stack) -> None:
    choices = ["yes", "no", "maybe later"]
    out = complete(stack.client(), max_tokens=8, extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    assert out.choices[0].finish_reason == "stop"


def test_one_compile_serves_the_prefill_and_the_decode(stack: Stack) -> None:
    """The prefill compiles the guide for the first token and leaves it in the shared
    directory; the decode that continues the request loads it instead of compiling."""

    def compiles(service: ServiceProcess, source: str) -> float:
        return metric(service.metrics_url, "pdserve_guided_compiles_total", source=source)

    before = {
        (name, source): compiles(service, source)
        for name, service in (("prefill", stack.prefill), ("decode", stack.decode))
        for source in ("compiled", "shared")
    }
    choices = ["alpha beta gamma delta one", "epsilon zeta eta theta two"]
    out = complete(stack.client(), max_tokens=48, extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    assert compiles(stack.prefill, "compiled") == before["prefill", "compiled"] + 1
    assert compiles(stack.decode, "shared") == before["decode", "shared"] + 1
    assert compiles(stack.decode, "compiled") == before["decode", "compiled"]


def test_guided_regex_full_match(stack: Stack) -> None:
    out = complete(stack.client(), max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text), out.choices[0].text


def test_chat_json_schema_response_format(stack: Stack) -> None:
    # An enum-only schema: every instance is short, so a few tokens always complete it.
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = stack.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Is it ok? Answer in JSON."}],
        max_tokens=24,
        temperature=0.0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    body = out.choices[0].message.content or ""
    assert out.choices[0].finish_reason == "stop", body
    value = json.loads(body)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)


def test_structured_outputs_is_vllms_newer_form(stack: Stack) -> None:
    """vLLM's ``structured_outputs`` object guides as the ``guided_*`` fields do."""
    client = stack.client()
    choices = ["red", "green", "blue sky"]
    out = complete(client, extra_body={"structured_outputs": {"choice": choices}})
    assert out.choices[0].text in choices
    out = complete(client, extra_body={"structured_outputs": {"regex": "[a-c]{4}"}})
    assert re.fullmatch(r"[a-c]{4}", out.choices[0].text), out.choices[0].text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    out = complete(client, max_tokens=24, extra_body={"structured_outputs": {"json": schema}})
    assert set(json.loads(out.choices[0].text)) == {"ok"}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag is not supported"),
        ({}, "structured_outputs needs one of"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "[0-9]", "choice": ["a"]}, "at most one"),
    ],
)
def test_bad_structured_outputs_is_400(stack: Stack, spec: dict[str, object], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        complete(stack.client(), extra_body={"structured_outputs": spec})


def test_invalid_regex_is_400_with_parser_message(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(stack.client(), extra_body={"guided_regex": "(ab"})
    assert info.value.status_code == 400
    assert "invalid guided regex" in str(info.value)
    assert "parenthesis" in str(info.value).lower()


def test_two_guides_is_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="at most one"):
        complete(
            stack.client(),
            extra_body={"guided_regex": "[0-9]+", "guided_choice": ["a", "b"]},
        )


def test_json_schema_without_schema_is_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError, match="schema"):
        complete(stack.client(), extra_body={"response_format": {"type": "json_schema"}})


def test_speculative_decode_same_greedy_tokens(stack: Stack) -> None:
    args = {"max_tokens": 24, "extra_body": {"ignore_eos": True}}
    plain = complete(stack.client(), **args).choices[0].text
    spec = complete(stack.client(stack.spec_router), **args).choices[0].text
    assert spec == plain
    # Speculation is on for that instance: its counters are exported, with the method. (The
    # tiny random model rarely repeats a token, so the n-gram drafter may find no match:
    # drafting and acceptance themselves are the engine tests' business.)
    samples = scrape(stack.spec_decode.metrics_url)
    labels = (("method", "ngram"), ("role", "decode"))
    drafted = samples[("pdserve_spec_draft_tokens_total", labels)]
    accepted = samples[("pdserve_spec_accepted_tokens_total", labels)]
    assert 0 <= accepted <= drafted


def test_up_passes_speculative_to_decode_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--decode", "2", "--speculative", "ngram:k=4,n=3"]
    children = plan(tmp_path, argv, monkeypatch)
    assert flag(children["decode-0"], "--speculative") == "ngram:k=4,n=3"
    assert flag(children["decode-1"], "--speculative") == "ngram:k=4,n=3"
    assert flag(children["prefill-0"], "--speculative") is None
    assert flag(children["router"], "--speculative") is None
    off = plan(tmp_path, [], monkeypatch)
    assert all(flag(child, "--speculative") is None for child in off.values())


def test_service_speculative_flag_and_env_reach_engine_config(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.config import EngineConfig
    from service.roles import add_arguments
    from service.settings import engine_config_from_args

    def config(argv: list[str]) -> EngineConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser, "decode")
        return engine_config_from_args(parser.parse_args(["--model", str(tiny_model_dir), *argv]))

    monkeypatch.delenv("PDSERVE_SPECULATIVE", raising=False)
    assert config([]).speculative is None
    assert config(["--speculative", "ngram:k=2"]).speculative == "ngram:k=2"
    monkeypatch.setenv("PDSERVE_SPECULATIVE", "ngram:k=3")
    assert config([]).speculative == "ngram:k=3"
    with pytest.raises(ValueError, match="ngram"):
        config(["--speculative", "bogus:k=4"])
