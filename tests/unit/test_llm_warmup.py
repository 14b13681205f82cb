"""The offline ``LLM`` warm-up pass (engine/llm_warmup.py) and its CUDA defaults, on the
CPU with a tiny random model: the pass covers a full-budget prefill and mixed steps, leaves
the engine idle with an empty prefix cache, and changes no output."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.llm import CUDA_OFFLINE_MAX_BATCHED_TOKENS, LLM
from engine.llm_warmup import warm_up, warmup_prompts

KW = dict(max_model_len=256, kv_cache_memory=1 << 22, max_num_batched_tokens=128)


def test_warmup_changes_no_output(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 60))]
    cold = LLM(str(tiny_model_dir), warmup=False, **KW)
    assert cold.warmup_seconds == 0.0
    warm = LLM(str(tiny_model_dir), warmup=True, **KW)
    assert warm.warmup_seconds > 0.0
    engine = warm.engine
    assert not engine.has_unfinished() and not engine.scheduler.requests
    # Its blocks are all free again and none is kept as a cached prefix.
    assert engine.kv.pool.num_free_blocks == cold.engine.kv.pool.num_free_blocks
    a = cold.generate(prompts, params)
    b = warm.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert b[0].prompt_token_ids == prompts[0] and len(b[2].token_ids) == 12


def test_warmup_prompts_cover_a_full_prefill_and_mixed_steps(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), warmup=False, max_num_seqs=16, **KW)
    prompts = warmup_prompts(llm.engine)
    cfg = llm.engine.config
    assert 1 < len(prompts) <= cfg.max_num_seqs
    # At least two budgets of prompt tokens: one full prefill step, then chunks that run
    # next to the first requests' decodes.
    assert sum(map(len, prompts)) >= 2 * cfg.max_num_batched_tokens
    assert max(map(len, prompts)) < llm.engine.max_model_len
    assert len(set(map(len, prompts))) > 1  # ragged
    # Counting the steps by kind: the pass met a full-budget step and a mixed one.
    kinds: list[tuple[int, bool]] = []
    schedule = llm.engine.scheduler.schedule

    def spy() -> object:
        out = schedule()
        n = sum(s.num_new_tokens for s in out.scheduled)
        mixed = len({s.num_new_tokens == 1 for s in out.scheduled}) == 2
        kinds.append((n, mixed))
        return out

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    warm_up(llm.engine)
    assert any(n == cfg.max_num_batched_tokens for n, _ in kinds)
    assert any(mixed for _, mixed in kinds)
    # The lone pass: a step with one request's prefill and then batch-1 decodes.
    batch_sizes: list[int] = []

    def count() -> object:
        out = schedule()
        batch_sizes.append(len(out.scheduled))
        return out

    llm.engine.scheduler.schedule = count  # type: ignore[method-assign]
    warm_up(llm.engine)
    assert batch_sizes[-1] == 1 and batch_sizes.count(1) > 1


def test_warmup_refuses_a_busy_engine(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), warmup=False, **KW)
    llm.engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(llm.engine)


def test_cpu_keeps_engine_defaults(tiny_model_dir: Path) -> None:
    """The CUDA offline defaults do not touch the CPU path (no warm-up, engine budget)."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory=1 << 22)
    assert llm.warmup_seconds == 0.0
    assert llm.engine.config.max_num_batched_tokens != CUDA_OFFLINE_MAX_BATCHED_TOKENS
