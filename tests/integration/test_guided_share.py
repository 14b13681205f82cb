"""Compiled grammars shared by instances through ``--guided-cache-dir`` (issue 24 item 4;
engine/sampling/grammar_share.py), with real engines and real helper processes: the
first engine compiles a guide and leaves it in the directory, a second engine (its own
helper) loads it instead of compiling and generates the same tokens; a corrupted entry is
ignored and compiled again; without the directory nothing is written."""

from __future__ import annotations

import zlib
from pathlib import Path

from engine.core.guided_spec import GuidedSpec
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine_steps import outputs_until_done

GUIDE = GuidedSpec.choice([f"option {i} of the shared list" for i in range(200)])


def _guided_tokens(engine: LLMEngine) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, guided=GUIDE)
    engine.add_request("g", [1, 2, 3, 4], params)
    tokens: list[int] = []
    # A deadline in seconds (tests/engine_steps.py): the compile helper's start and compile
    # make steps that return nothing.
    for out in outputs_until_done(engine, 120.0):
        assert not out.error, out.error
        tokens.extend(out.new_token_ids)
    return tokens


def engine_counts(engine: LLMEngine) -> dict[str, int]:
    return engine.guided.compile_counts()


def test_second_instance_loads_the_first_ones_compile(engine_factory, tmp_path: Path) -> None:
    share = tmp_path / "grammars"
    first = engine_factory(guided_cache_dir=str(share))
    expected = _guided_tokens(first)
    assert expected and engine_counts(first) == {"compiled": 1, "shared": 0}
    (entry,) = share.glob("*/*.json.z")  # one tokenizer directory, one guide

    second = engine_factory(guided_cache_dir=str(share))
    assert _guided_tokens(second) == expected
    assert engine_counts(second) == {"compiled": 0, "shared": 1}

    entry.write_bytes(zlib.compress(b'{"not": "a compiled grammar"}'))
    third = engine_factory(guided_cache_dir=str(share))
    assert _guided_tokens(third) == expected  # compiled again, not misled
    assert engine_counts(third)["shared"] == 0
    assert zlib.decompress(entry.read_bytes()) != b'{"not": "a compiled grammar"}'  # shared again


def test_no_directory_no_sharing(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory()
    assert _guided_tokens(engine)
    assert engine_counts(engine)["shared"] == 0
    assert list(tmp_path.iterdir()) == []
