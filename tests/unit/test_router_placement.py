"""The placement rule for decode-first and the local suffix (router/legs/placement.py,
docs/design.md §5 "Local suffix"): which decode instance computes the rest of a prompt
itself, by how much of it its live KV events say it holds. The pools are stand-ins with the
attributes the rule reads; the index's ``Match`` and the metrics are the real ones (the
processes' path is tests/e2e/test_router_local_suffix.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from router.legs.placement import Placement
from router.legs.trace import Job, Trace
from router.metrics import RouterMetrics
from router.routing.kv_index import Match
from router.routing.pool import LoadSnapshot

BLOCK = 16


@dataclass
class _Inst:
    url: str
    load: LoadSnapshot = field(default_factory=LoadSnapshot)

    def load_score(self) -> float:
        return self.load.waiting * 4 + self.load.running


@dataclass
class _Index:
    held: dict[str, Match]

    def match(self, urls: list[str], hashes: list[bytes]) -> dict[str, Match]:
        return {url: self.held.get(url, Match()) for url in urls}


@dataclass
class _Pool:
    instances: list[_Inst]
    kv_index: _Index
    live: bool = True

    def healthy(self) -> list[_Inst]:
        return self.instances

    def events_live(self, url: str) -> bool:
        return self.live


@dataclass
class _Leg:
    decode_pool: _Pool
    prefill_pool: _Pool
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    block_size: int = BLOCK


def _job(tokens: int) -> Job:
    hashes = [bytes([i]) for i in range(tokens // BLOCK)]
    return Job("r", list(range(tokens)), hashes, params=None, max_tokens=4)  # type: ignore[arg-type]


def _place(held: dict[str, Match], tokens: int, **kw: Any) -> tuple[str, Trace, Job]:
    decodes = [_Inst(url) for url in ("d0", "d1")]
    leg = _Leg(_Pool(decodes, _Index(held)), _Pool([_Inst("p0")], _Index({})))
    if "loads" in kw:
        for inst, running in zip(decodes, kw.pop("loads"), strict=True):
            inst.load.running = running
    placement = Placement(leg, "disaggregated", **kw)  # type: ignore[arg-type]
    trace, job = Trace(), _job(tokens)
    trace.decision = placement.decide(job, trace)  # what the orchestrator records
    return trace.decision, trace, job


def test_short_missing_suffix_goes_to_the_decode_holding_the_prefix() -> None:
    # 10 full blocks + 4 tokens; d1 holds 8 blocks: 36 tokens missing.
    decision, trace, job = _place({"d1": Match(8, device=8)}, 164, max_local_prefill_tokens=36)
    assert decision == "local_suffix" and job.decode_pin == "d1"
    assert trace.placement["local_suffix"]["missing_tokens"] == 36
    assert trace.prefill_path() == "local"


def test_over_the_threshold_or_zero_goes_remote() -> None:
    held = {"d1": Match(8, device=8)}
    assert _place(held, 164, max_local_prefill_tokens=35)[0] == "remote_prefill"
    assert _place(held, 164, max_local_prefill_tokens=0)[0] == "remote_prefill"
    assert _place(held, 164, decode_first=False)[0] == "remote_prefill"
    # Nothing held: even a short prompt goes to the prefill pool.
    decision, trace, _ = _place({}, 40)
    assert decision == "remote_prefill" and trace.prefill_path() == "remote"


def test_whole_prompt_is_decode_first_and_wins_over_a_partial_holder() -> None:
    held = {"d0": Match(9, device=5, host=4), "d1": Match(10, device=6, host=4)}
    decision, trace, job = _place(held, 164)
    assert decision == "decode_first" and job.decode_pin == "d1"
    assert trace.placement["decode_first"]["missing_tokens"] == 4
    # Whole prompts stay decode-first with the local suffix off.
    assert _place(held, 164, max_local_prefill_tokens=0)[0] == "decode_first"


def test_store_only_blocks_in_the_run_count_nothing_held() -> None:
    # Its fast blocks need not be the leading ones: not known to lack only a suffix.
    held = {"d0": Match(9, device=8, store=1)}
    assert _place(held, 164)[0] == "remote_prefill"


def test_a_skewed_holder_is_skipped() -> None:
    decision, trace, _ = _place({"d1": Match(8, device=8)}, 164, loads=[0, 20])
    assert decision == "remote_prefill"
    assert trace.placement["local_suffix_skipped"] == "d1"


def test_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="max_local_prefill_tokens"):
        _place({}, 40, max_local_prefill_tokens=-1)
