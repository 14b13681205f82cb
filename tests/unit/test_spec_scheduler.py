"""How the scheduler treats drafts (no model): they ride along only on decode steps, are
trimmed to the token budget, are dropped before anyone is preempted, and never reach the
prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

BS = 4


@pytest.fixture()
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path


def _setup(config_dir: Path, blocks: int, budget: int) -> tuple[Scheduler, KVCacheManager]:
    cfg = EngineConfig(
        model=str(config_dir),
        load_format="dummy",
        block_size=BS,
        num_kv_blocks=blocks,
        max_num_batched_tokens=budget,
    )
    kv = KVCacheManager(blocks, BS, enable_caching=True)
    return Scheduler(cfg, kv), kv


def _decoding(sched: Scheduler, rid: str, prompt: list[int]) -> Request:
    """A running request whose prompt is computed and first token sampled."""
    request = Request(rid, list(prompt), SamplingParams(max_tokens=32))
    sched.add_request(request)
    out = sched.schedule()
    assert request in [s.request for s in out.scheduled]
    request.num_computed_tokens = len(prompt)
    request.append_output_token(7)
    return request


def test_drafts_scheduled_on_decode_and_trimmed_to_budget(config_dir: Path) -> None:
    sched, _ = _setup(config_dir, blocks=64, budget=4)
    request = _decoding(sched, "a", [1, 2, 3, 4, 5])
    request.spec_token_ids = [8, 9, 10, 11, 12]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 4 and s.spec_token_ids == [8, 9, 10]  # 1 pending + 3 drafts


def test_drafts_ignored_while_prefilling(config_dir: Path) -> None:
    sched, _ = _setup(config_dir, blocks=64, budget=3)
    request = Request("p", list(range(1, 10)), SamplingParams(max_tokens=4))
    request.spec_token_ids = [5, 5]
    sched.add_request(request)
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 3 and s.spec_token_ids == []


def test_drafts_dropped_before_preempting(config_dir: Path) -> None:
    # 4 usable blocks of 4 tokens: two requests of 7 tokens hold 2 blocks each, none free.
    sched, kv = _setup(config_dir, blocks=5, budget=64)
    a = _decoding(sched, "a", [1, 2, 3, 4, 5, 6])
    b = _decoding(sched, "b", [9, 8, 7, 6, 5, 4])
    assert kv.pool.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]  # would need 2 more blocks
    out = sched.schedule()
    assert not out.preempted and all(r.status is RequestStatus.RUNNING for r in (a, b))
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["a"].spec_token_ids == [] and by_id["a"].num_new_tokens == 1


def test_draft_positions_never_registered(config_dir: Path) -> None:
    sched, kv = _setup(config_dir, blocks=64, budget=64)
    request = _decoding(sched, "a", [1, 2, 3])  # tokens: 1 2 3 7 -> one full block pending KV
    request.spec_token_ids = [4, 5, 6, 7, 8]  # would fill a second block with drafts
    (s,) = sched.schedule().scheduled
    assert s.num_new_tokens == 6
    # Block 0 holds verified tokens (its last one is computed this step): registered.
    # Block 1 would hold only drafts: not registered.
    assert len(kv.pool.cached) == 1
    assert kv.req_to_blocks["a"][0].block_hash is not None
    assert kv.req_to_blocks["a"][1].block_hash is None
