"""Grammar compiles run in their own process, under a memory and a time budget (issue 24
item 4; engine/sampling/grammar_worker.py).

A choice list of 3000 long strings needs hundreds of MB and seconds to compile with
SmolLM2's vocabulary (about 2.5 s on the 2-core machine). Here, with real helper processes:

- over ``guided_compile_memory`` (64Mi) the compile fails in its child, the request is
  refused naming the limit, the guide is then refused at once, the engine process did not
  grow by the compile's memory, and no compile child is left behind;
- over ``guided_compile_timeout`` (0.5 s) the child is killed and the request refused naming
  that limit, while a plain request beside it ran all its steps during the compile;
- a compiled grammar (MBs of xgrammar JSON) reaches the step loop as a ready object, made
  on the helper's reader thread, and the engine process never parses it as part of a JSON
  message (that parse held the GIL, so every thread of the engine, the step loop's
  included, stopped for it; issue 36, benchmarks/engine/grammar_load_stall.py).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest

from engine.core.guided_spec import GuidedSpec
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.sampling import grammar_worker
from engine.sampling.guided import GUIDE_REFUSED
from tests.engine_steps import outputs_until_done

RUN_DEADLINE_S = 180.0
# The bomb compiles in about 2.5 s here (measured); 3 s once let it through on this machine.
TIME_BUDGET_S = 0.5
BOMB = GuidedSpec.choice([f"choice number {i} " + "z" * 40 for i in range(3000)])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, str], bool]:
    """Step until done: tokens and errors by request, and whether the plain request ended
    while the guided one was still compiling."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    plain_done_during_compile = False
    # A deadline in seconds (tests/engine_steps.py): while only the compile is pending a
    # step is a few microseconds, and a bound of 100,000 steps once ran out before 3 s did.
    for out in outputs_until_done(engine, RUN_DEADLINE_S):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.error:
            errors[out.request_id] = out.error
        if out.request_id == "plain" and out.finished:
            plain_done_during_compile = engine.guided.has_pending()
    return tokens, errors, plain_done_during_compile


def test_compile_over_its_memory_budget_is_refused_and_its_memory_returned(engine_factory) -> None:
    engine = engine_factory(guided_compile_memory=64 << 20, guided_compile_timeout=120)
    rss_before = _rss_mib(os.getpid())
    engine.add_request("bomb", [1, 2, 3], SamplingParams(max_tokens=4, guided=BOMB))
    _, errors, _ = _run(engine)
    assert errors["bomb"].startswith(GUIDE_REFUSED)
    assert "--guided-compile-memory" in errors["bomb"] and str(64 << 20) in errors["bomb"]
    with pytest.raises(ValueError, match="--guided-compile-memory"):
        engine.add_request("again", [1, 2, 3], SamplingParams(max_tokens=4, guided=BOMB))
    # The compile's memory was its child's: this process holds only the tokenizer's view.
    assert _rss_mib(os.getpid()) - rss_before < 150
    helper = engine.guided._worker._proc  # noqa: SLF001 - the helper process itself
    assert helper is not None and helper.poll() is None
    assert _children_of(helper.pid) == [], "a compile child outlived its compile"


def test_compile_over_its_time_budget_is_killed_while_others_step(engine_factory) -> None:
    engine = engine_factory(guided_compile_timeout=TIME_BUDGET_S)
    engine.add_request("bomb", [1, 2, 3], SamplingParams(max_tokens=4, guided=BOMB))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", [4, 5, 6, 7], plain)
    tokens, errors, plain_during = _run(engine)
    assert len(tokens["plain"]) == 8 and "plain" not in errors
    assert plain_during, "the plain request waited for the compile"
    assert "--guided-compile-timeout" in errors["bomb"] and f"{TIME_BUDGET_S:g} s" in errors["bomb"]
    helper = engine.guided._worker._proc  # noqa: SLF001
    assert _children_of(helper.pid) == []


def test_a_compiled_grammar_reaches_the_step_loop_ready_and_unparsed(
    engine_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory()
    parsed: list[int] = []  # sizes of the JSON documents the engine process parsed
    decoded_on: list[int] = []  # threads that turned a result into an object

    class RecordingJson:
        dumps = staticmethod(json.dumps)

        @staticmethod
        def loads(doc: Any) -> Any:
            parsed.append(len(doc))
            return json.loads(doc)

    monkeypatch.setattr(grammar_worker, "json", RecordingJson)
    worker = engine.guided._get_worker()  # noqa: SLF001 - wrap its decode to see its thread
    decode = worker.decode

    def recording_decode(text: str) -> Any:
        decoded_on.append(threading.get_ident())
        return decode(text)

    worker.decode = recording_decode
    choices = [f"option {i} " + "q" * 30 for i in range(300)]
    engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=40, guided=GuidedSpec.choice(choices)))  # fmt: skip
    tokens, errors, _ = _run(engine)
    assert "g" not in errors
    assert engine.tokenizer.decode(tokens["g"], skip_special_tokens=True) in choices
    assert decoded_on and threading.get_ident() not in decoded_on  # never on the step loop
    assert max(parsed) < 4096, f"the engine parsed a {max(parsed)}-byte JSON message"
