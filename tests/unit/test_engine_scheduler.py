"""Scheduler invariants over randomized workloads, driving Scheduler + KVCacheManager
directly (no model): each step schedules, then does what StepOutputs.process does
(advance computed counters, append a token when a request is caught up, finish at
max_tokens). Tokens are a pure function of the request and position, so a preempted and
recomputed request must end with exactly the tokens it would have had anyway."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput

BS = 16


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only model directory: the scheduler never loads weights."""
    d = tmp_path_factory.mktemp("sched_model")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return d


def fake_token(request: Request) -> int:
    return (request.num_tokens * 7919 + sum(request.prompt_token_ids[:4])) % 1000 + 100


@dataclass
class Harness:
    sched: Scheduler
    kv: KVCacheManager
    config: EngineConfig
    finished: list[Request] = field(default_factory=list)
    admitted_order: list[str] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0

    def add(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int,
        priority: int = 0,
        seed: int = 0,
        prefix: list[int] | None = None,
    ) -> Request:
        rng = random.Random(f"{rid}:{seed}")
        prompt = list(prefix or []) + [rng.randrange(100, 5000) for _ in range(prompt_len)]
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        running_before = list(self.sched.running)
        out = self.sched.schedule()
        self.steps += 1
        self.preemptions += len(out.preempted)
        check_step(self, out, running_before)
        for s in out.scheduled:
            r = s.request
            if r.first_scheduled_time is not None and r.request_id not in self.admitted_order:
                self.admitted_order.append(r.request_id)
            r.num_computed_tokens += s.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(fake_token(r))
                if len(r.output_token_ids) >= r.params.max_tokens:
                    self.sched.finish(r, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(r)
        check_pool(self)
        return out

    def run(self, max_steps: int) -> None:
        while self.sched.has_work():
            assert self.steps < max_steps, "requests starved: the workload did not finish"
            self.step()


def make(config_dir: Path, num_blocks: int = 4096, **overrides: object) -> Harness:
    cfg = EngineConfig(model=str(config_dir), load_format="dummy", block_size=BS, **overrides)  # type: ignore[arg-type]
    kv = KVCacheManager(num_blocks, BS, cfg.enable_prefix_caching)
    return Harness(Scheduler(cfg, kv), kv, cfg)


def check_step(h: Harness, out: SchedulerOutput, running_before: list[Request]) -> None:
    cfg = h.config
    total = sum(s.num_new_tokens for s in out.scheduled)
    assert total <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert total == out.num_batched_tokens
    assert len(h.sched.running) <= cfg.max_num_seqs, "max_num_seqs exceeded"
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    preempted = set(out.preempted)
    still_running = [r for r in running_before if r.request_id not in preempted]
    was_running = {r.request_id for r in still_running}
    # Decode first: every request that was already running comes before any admitted one.
    kinds = [s.request.request_id in was_running for s in out.scheduled]
    assert kinds == sorted(kinds, reverse=True), (
        "a waiting request was scheduled before a running one"
    )
    admitted = [s for s in out.scheduled if s.request.request_id not in was_running]
    if admitted:
        # Admitting someone new means every running request got all it could use.
        got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        for r in still_running:
            pending = r.num_tokens - r.num_computed_tokens
            assert got.get(r.request_id) == pending, f"{r.request_id} shortchanged for a newcomer"
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens >= 1
        assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        need = -(-(r.num_computed_tokens + s.num_new_tokens) // BS)
        assert len(s.block_ids) >= need, "scheduled without enough KV slots"
        assert 0 not in s.block_ids, "block 0 handed out"


def check_pool(h: Harness) -> None:
    pool = h.kv.pool
    in_use = {b.block_id for blocks in h.kv.req_to_blocks.values() for b in blocks}
    refs = sum(b.ref_cnt for b in pool.blocks)
    assert refs == sum(len(v) for v in h.kv.req_to_blocks.values())
    assert pool.num_free_blocks + len(in_use) == pool.num_usable_blocks
    for r in h.sched.running:
        assert h.kv.num_blocks_of(r.request_id) * BS >= r.num_computed_tokens


def expected_tokens(req: Request) -> list[int]:
    """Tokens an unpreempted run produces (fake_token depends only on position)."""
    probe = Request("probe", list(req.prompt_token_ids), req.params)
    while len(probe.output_token_ids) < req.params.max_tokens:
        probe.append_output_token(fake_token(probe))
    return probe.output_token_ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_randomized_workload_invariants(config_dir: Path, seed: int, policy: str) -> None:
    rng = random.Random(seed)
    h = make(
        config_dir,
        num_blocks=rng.choice([12, 24, 400]),
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([16, 40, 256]),
        scheduling_policy=policy,
        enable_prefix_caching=seed % 2 == 0,
    )
    # Two shared prefixes (prefix-cache hits), lengths across block boundaries.
    prefixes = [
        [],
        [rng.randrange(100, 5000) for _ in range(33)],
        [rng.randrange(100, 5000) for _ in range(16)],
    ]
    reqs = []
    pending_arrivals = sorted((rng.randrange(0, 40), i) for i in range(30))
    while pending_arrivals or h.sched.has_work():
        while pending_arrivals and pending_arrivals[0][0] <= h.steps:
            _, i = pending_arrivals.pop(0)
            plen = rng.choice([1, 5, 16, 17, 40, 60])
            prefix = rng.choice(prefixes)
            reqs.append(h.add(f"r{i}", plen, rng.randint(1, 40), rng.randint(0, 3), seed, prefix))
        if h.sched.has_work():
            h.step()
        else:
            h.steps += 1  # idle tick until the next arrival
        assert h.steps < 5000, "workload did not finish"
    assert len(h.finished) == len(reqs)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_tokens(r)
    assert h.kv.pool.num_free_blocks == h.kv.pool.num_usable_blocks


def test_chunked_prefill_mixes_with_decodes(config_dir: Path) -> None:
    h = make(config_dir, max_num_batched_tokens=32, max_num_seqs=8)
    short = h.add("short", 4, 20)
    h.step()  # short's prefill
    long = h.add("long", 100, 2)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = h.step()
        sched = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert sched.get("short") == 1, "the decode must ride along every step"
        chunks.append(sched["long"])
    assert chunks == [31, 31, 31, 7]
    assert short.num_computed_tokens > 4


def test_no_chunking_waits_for_budget(config_dir: Path) -> None:
    h = make(config_dir, max_num_batched_tokens=32, enable_chunked_prefill=False)
    h.add("a", 20, 3)
    h.add("b", 20, 3)  # does not fit next to a's 20 tokens in one step
    out = h.step()
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    h.run(100)
    assert [r.request_id for r in h.finished] == ["a", "b"]


def test_fcfs_admission_order_and_no_starvation(config_dir: Path) -> None:
    h = make(config_dir, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(10):
        h.add(f"r{i}", 10 + (i * 7) % 30, 1 + i % 4)
    h.run(500)
    assert h.admitted_order == [f"r{i}" for i in range(10)]
    assert len(h.finished) == 10


def test_priority_policy_admits_lowest_value_first(config_dir: Path) -> None:
    h = make(config_dir, max_num_seqs=1, scheduling_policy="priority")
    h.add("blocker", 4, 3, priority=0)
    h.step()  # blocker occupies the only sequence slot
    for rid, prio in [("p5", 5), ("p1a", 1), ("p3", 3), ("p1b", 1), ("p0", 0)]:
        h.add(rid, 4, 2, priority=prio)
    h.run(200)
    assert h.admitted_order == ["blocker", "p0", "p1a", "p1b", "p3", "p5"]


def test_priority_preempts_least_important(config_dir: Path) -> None:
    # 9 usable blocks: three requests of 48-tokens-and-growing cannot all keep running.
    h = make(
        config_dir,
        num_blocks=10,
        max_num_seqs=3,
        max_num_batched_tokens=512,
        scheduling_policy="priority",
    )
    h.add("low", 40, 30, priority=9)
    h.add("high", 40, 30, priority=0)
    h.add("mid", 40, 30, priority=5)
    victims: list[str] = []
    while h.sched.has_work():
        victims += h.step().preempted
        assert h.steps < 1000
    assert victims and victims[0] == "low"
    assert "high" not in victims


def test_preemption_under_tiny_pool_recomputes_and_finishes(config_dir: Path) -> None:
    h = make(config_dir, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=128)
    reqs = [h.add(f"r{i}", 30, 40) for i in range(4)]  # 70 tokens = 5 blocks each; 7 usable
    h.run(2000)
    assert h.preemptions > 0, "the pool was meant to force preemption"
    assert any(r.num_preemptions > 0 for r in reqs)
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r)
    assert h.kv.pool.num_free_blocks == 7


def test_abort_waiting_and_running_frees_blocks(config_dir: Path) -> None:
    h = make(config_dir, max_num_seqs=1)
    a = h.add("a", 20, 50)
    b = h.add("b", 20, 50)
    h.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    h.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    h.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not h.sched.has_work()
    assert h.kv.pool.num_free_blocks == h.kv.pool.num_usable_blocks
    assert "a" not in h.sched.requests and "b" not in h.sched.requests


def test_prefix_hit_skips_cached_prompt_tokens(config_dir: Path) -> None:
    h = make(config_dir, max_num_batched_tokens=256)
    first = h.add("first", 40, 1)
    h.run(50)
    second = Request("second", list(first.prompt_token_ids) + [7, 7], SamplingParams(max_tokens=1))
    h.sched.add_request(second)
    out = h.step()
    assert out.scheduled[0].num_new_tokens == 42 - 32  # two full blocks came from the cache
    assert second.num_cached_tokens == 32
