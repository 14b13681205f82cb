"""The engine's features under tensor parallelism (N = 2, CPU, gloo, a real worker
process): guided decoding, speculative decoding (n-gram and a draft model, which runs
whole on rank 0) and the prefix cache give the same tokens as N = 1 on the same tiny
float32 Llama. Guided and speculative decoding act on rank 0's full logits, so any
difference here would mean the sharded logits, the step hand-out or the rows of a
multi-token verify step are wrong. ``test_tensor_parallel.py`` covers greedy parity with
transformers, chunked prefill, preemption, async scheduling, seeded sampling and failures.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.core.guided_spec import GuidedSpec
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.model_fixtures import make_tiny_llama

SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
REGEX = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,5})?"


def _engine(model_dir: Path, tp: int, **overrides: Any) -> LLMEngine:
    config = {"num_kv_blocks": 256} | overrides
    return LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, **config))


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _on_both(model_dir: Path, run: Any, **overrides: Any) -> tuple[Any, Any, LLMEngine]:
    """``run(engine)`` on N = 1 and on N = 2 (shut down afterwards); both results and the
    N = 2 engine (for its statistics)."""
    one = run(_engine(model_dir, 1, **overrides))
    engine = _engine(model_dir, 2, **overrides)
    try:
        two = run(engine)
    finally:
        engine.shutdown()
    return one, two, engine


def _guided(engine: LLMEngine) -> dict[str, tuple[list[int], str]]:
    """JSON-schema and regex requests, greedy and seeded-sampled, in one batch."""
    specs = {"json": GuidedSpec.json_schema(SCHEMA), "regex": GuidedSpec("regex", REGEX)}
    for kind, spec in specs.items():
        for i in range(4):
            temperature = 0.0 if i == 0 else 1.0
            params = SamplingParams(max_tokens=80, temperature=temperature, seed=i, guided=spec)
            engine.add_request(f"{kind}{i}", [1, 504, 9826, 28, 198 + i], params)
    outs = _drain(engine)
    assert not engine.guided._states, "matchers must be released when requests finish"
    return {rid: (_tokens(o), "".join(x.new_text for x in o)) for rid, o in outs.items()}


def test_tp2_guided_decoding_matches_tp1(tiny_model_dir: Path) -> None:
    one, two, _ = _on_both(tiny_model_dir, _guided)
    assert len(two) == 8
    for rid, (_, text) in two.items():
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), (rid, text)
    assert two == one


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random tiny Llama with the same tokenizer: a draft that is often wrong."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_tp_draft"), seed=5)


def _spec_prompts(seed: int) -> list[list[int]]:
    """Repetitive prompts (the n-gram proposer finds matches) and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(6):
        if i % 2 == 0:
            unit = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 7))]
            prompts.append((unit * 12)[: rng.randrange(12, 50)])
        else:
            prompts.append([rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))])
    return prompts


def _speculate(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy and seeded-sampled requests, staggered so verify steps mix with prefills."""
    prompts = _spec_prompts(seed=3)
    pending = list(enumerate(prompts))
    got: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        for _ in range(min(2, len(pending))):
            i, prompt = pending.pop(0)
            temperature = 0.0 if i < 4 else 0.8
            params = SamplingParams(
                max_tokens=16, temperature=temperature, seed=50 + i, ignore_eos=True
            )
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks, "blocks leaked"
    return got


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_speculative_decoding_matches_tp1(
    tiny_model_dir: Path, draft_dir: Path, method: str
) -> None:
    spec = "ngram:k=4,n=3" if method == "ngram" else f"draft:model={draft_dir},k=3"
    one, two, engine = _on_both(
        tiny_model_dir, _speculate, speculative=spec, max_num_batched_tokens=40
    )
    stats = engine.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0, stats
    if method == "ngram":  # repetitive prompts: some drafts are right (multi-token steps)
        assert stats.num_accepted_tokens > 0, stats
    assert all(len(t) == 16 for t in two.values())
    assert two == one


def _twice(engine: LLMEngine) -> list[tuple[list[int], int, list[float]]]:
    """The same 50-token prompt twice, one after the other: (tokens, cached prompt tokens,
    the sampled tokens' logprobs)."""
    rng = random.Random(21)
    prompt = [rng.randrange(3, 49152) for _ in range(50)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    results = []
    for rid in ("first", "second"):
        engine.add_request(rid, prompt, params)
        outs = _drain(engine)[rid]
        logprobs = [lp.logprob for o in outs for lp in o.logprobs or []]
        results.append((_tokens(outs), outs[-1].num_cached_tokens, logprobs))
    return results


def test_tp2_prefix_cache_hit_gives_identical_output(tiny_model_dir: Path) -> None:
    one, two, _ = _on_both(tiny_model_dir, _twice, block_size=8)
    (first, cached_first, lp_first), (second, cached_second, lp_second) = two
    assert cached_first == 0
    assert cached_second == 48, "the second identical prompt reuses its 6 full blocks"
    assert second == first
    assert len(lp_first) == 10 and lp_second == pytest.approx(lp_first, abs=1e-4)
    assert [(t, c) for t, c, _ in two] == [(t, c) for t, c, _ in one]
    assert lp_first == pytest.approx(one[0][2], abs=1e-4)  # float sums in another order
