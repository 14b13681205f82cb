"""Conditional disaggregation through the router (docs/design.md §5, "Local suffix"): when
the chosen decode instance holds a prefix of the prompt (its KV events say so) and lacks at
most ``--max-local-prefill-tokens`` of it, the decode computes that suffix itself and no
prefill runs; a larger gap goes through the prefill, which computes only what its own
prefix cache lacks. ``usage.pdserve_timings`` says which path a request took
(``prefill_path``, ``prompt_tokens_computed`` / ``_cached`` there), as do the router's
``pdserve_disagg_decisions_total{decision="local_suffix"}`` and
``pdserve_prompt_tokens_computed_total{path}``.

Real processes: one prefill, one decode (fs connector), a disaggregated router with the
threshold and a colocated router on the same decode for the reference text; SmolLM2 and
the ``openai`` client, a multi-turn chat, greedy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.router_support import metric, openai_client, wait_for
from tests.service_fixtures import ProcessStack, ServiceProcess

THRESHOLD = 128
MAX_TOKENS = 12
# Long enough that turn 1 misses more than THRESHOLD tokens even where the decode holds the
# chat template's first block from an earlier request.
SYSTEM = "You are a tutor. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(30))


@dataclass(slots=True)
class Services:
    prefill: ServiceProcess
    decode: ServiceProcess
    disagg: ServiceProcess
    colocated: ServiceProcess


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("local_suffix")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", smollm2_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    common = ["--health-interval", "0.5", "--served-model-name", "m"]
    try:
        prefill, decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
        )
        disagg, colocated = procs.together(
            lambda: procs.router(
                prefill=[prefill],
                decode=[decode],
                extra_args=[*common, "--max-local-prefill-tokens", str(THRESHOLD)],
            ),
            lambda: procs.router(decode=[decode], mode="colocated", extra_args=common),
        )
        yield Services(prefill, decode, disagg, colocated)
    finally:
        procs.close()


def _chat(router: ServiceProcess, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    out = openai_client(router.url).chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "pdserve_timings": True},
    )
    assert out.usage is not None and out.usage.model_extra is not None
    extra = out.usage.model_extra
    usage = {
        **extra["pdserve_timings"],
        "decision": extra["pdserve_route"]["decision"],
        "prompt_tokens": out.usage.prompt_tokens,
    }
    return out.choices[0].message.content or "", usage


def _prefill_calls(s: Services) -> float:
    return metric(s.prefill.metrics_url, "pdserve_service_requests_total", rpc="Prefill")


def _decode_blocks_known(s: Services) -> float:
    return metric(s.disagg.url + "/metrics", "pdserve_kv_index_blocks", pool="decode")


def test_short_missing_suffix_is_computed_on_the_decode(services: Services) -> None:
    s = services
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Turn 1: what is a prime number?"},
    ]
    texts, usages = [], []
    text, first = _chat(s.disagg, messages)
    assert first["decision"] == "remote_prefill" and first["prefill_path"] == "remote", first
    assert first["prompt_tokens"] > THRESHOLD + 16, first
    texts.append(text)
    # The decode's KV events (the loaded prompt) reach the router's index.
    wait_for(lambda: _decode_blocks_known(s) > 0, 20, "the decode's KV events")

    # Turn 2: ~20 new tokens, under the threshold: the decode computes them, no prefill.
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Turn 2: and is 7 one?"},
    ]
    prefills = _prefill_calls(s)
    local_tokens = metric(
        s.disagg.url + "/metrics", "pdserve_prompt_tokens_computed_total", path="local"
    )
    text, second = _chat(s.disagg, messages)
    texts.append(text)
    usages.append(second)
    assert second["decision"] == "local_suffix" and second["prefill_path"] == "local", second
    assert 0 < second["prompt_tokens_computed"] <= THRESHOLD, second
    assert second["prompt_tokens_cached"] >= first["prompt_tokens"] - 16, second
    assert "kv_blocks_loaded" not in second  # no handoff
    assert _prefill_calls(s) == prefills, "the prefill served a local-suffix turn"
    assert (
        metric(s.disagg.url + "/metrics", "pdserve_prompt_tokens_computed_total", path="local")
        == local_tokens + second["prompt_tokens_computed"]
    )
    assert (
        metric(s.disagg.url + "/metrics", "pdserve_disagg_decisions_total", decision="local_suffix")
        >= 1
    )

    # Turn 3: over the threshold of new tokens: through the prefill, which computes only
    # what its own prefix cache (turn 1's prompt) lacks.
    long_question = "Turn 3: " + " ".join(f"Is {n} prime, and why?" for n in range(11, 41))
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": long_question},
    ]
    text, third = _chat(s.disagg, messages)
    texts.append(text)
    assert third["decision"] == "remote_prefill" and third["prefill_path"] == "remote", third
    assert third["prompt_tokens"] - second["prompt_tokens"] > THRESHOLD, third
    assert _prefill_calls(s) == prefills + 1
    assert third["prompt_tokens_cached"] >= first["prompt_tokens"] - 16, third
    assert third["prompt_tokens_computed"] < third["prompt_tokens"] - first["prompt_tokens"] + 16

    # Greedy text equals a colocated engine's for the same conversation, turn by turn.
    replay = messages[:2]
    for turn, expected in enumerate(texts):
        got, _ = _chat(s.colocated, replay)
        assert got == expected, f"turn {turn + 1}: {got!r} != {expected!r}"
        replay = messages[: 2 * turn + 4]
