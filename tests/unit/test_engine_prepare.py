"""``InputBuilder`` (what ``ModelRunner.prepare`` runs) against the straightforward per-token
construction, over many steps of one builder so its cached block-table rows are exercised:
chunked prefill, decode, drafts, requests leaving and coming back, a table replaced under a
new epoch (preemption), tables of unknown epoch, extra blocks allocated ahead, and
``Request.token_ids_slice`` / the block hashes that now use it."""

from __future__ import annotations

import random

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledRequest
from engine.executor.step_inputs import InputBuilder, logits_rows

BS = 4


def reference(scheduled: list[ScheduledRequest]) -> dict[str, object]:
    """Every input built token by token from the full token list (the pre-numpy code)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    max_blocks = 1
    for s in scheduled:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        tokens = req.all_token_ids + s.spec_token_ids
        ids.extend(tokens[start:end])
        positions.extend(range(start, end))
        slots.extend(s.block_ids[p // BS] * BS + p % BS for p in range(start, end))
        starts.append(len(ids))
        seq_lens.append(end)
        max_blocks = max(max_blocks, -(-end // BS))
    tables = torch.zeros((len(scheduled), max_blocks), dtype=torch.int32)
    for i, s in enumerate(scheduled):
        n = -(-seq_lens[i] // BS)
        tables[i, :n] = torch.tensor(s.block_ids[:n], dtype=torch.int32)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "slot_mapping": torch.tensor(slots, dtype=torch.long),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_tables": tables,
        "logits_indices": torch.tensor(logits_rows(scheduled, starts), dtype=torch.long),
        "max_query_len": max(b - a for a, b in zip(starts, starts[1:], strict=False)),
        "max_seq_len": max(seq_lens),
        "query_start_loc_cpu": starts,
        "seq_lens_cpu": seq_lens,
    }


def check(builder: InputBuilder, scheduled: list[ScheduledRequest]) -> None:
    got = builder.build(scheduled)
    want = reference(scheduled)
    for t in (got.input_ids, got.positions, got.logits_indices, got.meta.block_tables):
        assert t.is_contiguous()
        assert t.storage_offset() % 32 == 0  # staging-buffer segments start aligned
    m = got.meta
    actual = {
        "input_ids": got.input_ids,
        "positions": got.positions,
        "slot_mapping": m.slot_mapping,
        "query_start_loc": m.query_start_loc,
        "seq_lens": m.seq_lens,
        "block_tables": m.block_tables,
        "logits_indices": got.logits_indices,
        "max_query_len": m.max_query_len,
        "max_seq_len": m.max_seq_len,
        "query_start_loc_cpu": m.query_start_loc_cpu,
        "seq_lens_cpu": m.seq_lens_cpu,
    }
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            a = actual[key]
            assert isinstance(a, torch.Tensor)
            assert a.dtype == value.dtype and a.shape == value.shape, key
            assert torch.equal(a, value), (key, a, value)
        else:
            assert actual[key] == value, key
            assert type(actual[key]) is type(value), key


class Sim:
    """Requests with growing token lists and block tables, as the scheduler would make."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_block = 1
        self.epoch = 0
        self.reqs: dict[str, Request] = {}
        self.tables: dict[str, tuple[list[int], int]] = {}

    def new_table(self, rid: str) -> None:
        self.tables[rid] = ([], self.epoch)
        self.epoch += 1

    def ensure_blocks(self, rid: str, tokens: int) -> list[int]:
        table, _ = self.tables[rid]
        need = -(-tokens // BS) + self.rng.choice([0, 0, 0, 1, 2])  # sometimes allocate ahead
        while len(table) < need:
            table.append(self.next_block)
            self.next_block += 1
        return table

    def add(self, rid: str) -> None:
        prompt = [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 40))]
        self.reqs[rid] = Request(rid, prompt, SamplingParams(max_tokens=1000))
        self.new_table(rid)

    def schedule(self, rid: str) -> ScheduledRequest:
        req = self.reqs[rid]
        pending = req.num_tokens - req.num_computed_tokens
        spec: list[int] = []
        if pending == 1 and self.rng.random() < 0.2:
            spec = [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 4))]
        n_new = min(pending, self.rng.randrange(1, 20)) + len(spec)
        table = self.ensure_blocks(rid, req.num_computed_tokens + n_new)
        epoch = self.tables[rid][1] if self.rng.random() > 0.1 else -1
        return ScheduledRequest(req, n_new, list(table), spec, epoch)

    def advance(self, s: ScheduledRequest) -> None:
        req = s.request
        req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(self.rng.randrange(1000))


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_matches_reference_over_many_steps(seed: int, staged: bool) -> None:
    """``staged``: the packed staging-buffer path CUDA takes (a clone stands in for the
    host-to-device copy), so offsets, alignment padding and views are checked here too."""
    rng = random.Random(seed)
    sim = Sim(rng)
    # max_blocks_per_req is small on purpose: the host table must grow as needed.
    builder = InputBuilder(torch.device("cpu"), BS, max_blocks_per_req=8, staged=staged)
    for i in range(12):
        sim.add(f"r{i}")
    for step in range(80):
        rids = list(sim.reqs)
        rng.shuffle(rids)
        chosen = rids[: rng.randrange(1, len(rids) + 1)]
        if rng.random() < 0.3:  # preemption: KV dropped, a new table (maybe same length)
            victim = rng.choice(rids)
            sim.reqs[victim].num_computed_tokens = 0
            sim.new_table(victim)
        if rng.random() < 0.1:
            sim.add(f"new{step}")
        scheduled = [sim.schedule(rid) for rid in chosen]
        check(builder, scheduled)
        for s in scheduled:
            sim.advance(s)


@pytest.mark.parametrize("staged", [False, True])
def test_pure_decode_and_single_request(staged: bool) -> None:
    rng = random.Random(0)
    sim = Sim(rng)
    builder = InputBuilder(torch.device("cpu"), BS, max_blocks_per_req=64, staged=staged)
    for i in range(5):
        sim.add(f"r{i}")
        req = sim.reqs[f"r{i}"]
        req.num_computed_tokens = req.num_tokens - 1
    for _ in range(10):
        scheduled = [sim.schedule(rid) for rid in sim.reqs]
        for s in scheduled:
            s.spec_token_ids, s.num_new_tokens = [], 1
        check(builder, scheduled)
        check(builder, scheduled[:1])
        for s in scheduled:
            sim.advance(s)


def test_empty_step_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheduled"):
        InputBuilder(torch.device("cpu"), BS, 8).build([])


def test_token_ids_slice_and_block_hashes() -> None:
    rng = random.Random(1)
    for _ in range(200):
        req = Request(
            "r", [rng.randrange(50) for _ in range(rng.randrange(1, 30))], SamplingParams()
        )
        for _ in range(rng.randrange(0, 30)):
            req.append_output_token(rng.randrange(50))
        full = req.all_token_ids
        a = rng.randrange(0, len(full) + 1)
        b = rng.randrange(a, len(full) + 1)
        assert req.token_ids_slice(a, b) == full[a:b]
        req.update_block_hashes(BS)
        assert req.block_hashes == compute_block_hashes(full, BS)


@pytest.mark.parametrize("staged", [False, True])
def test_too_few_blocks_is_rejected_not_read_from_a_reused_row(staged: bool) -> None:
    """A request whose block_ids do not cover its tokens is a ValueError naming it. The
    host row it gets may have held another request's ids, which would otherwise become its
    slots (its KV written into the other request's blocks); a table narrower than the
    tokens need must not fail with an IndexError either."""
    builder = InputBuilder(torch.device("cpu"), BS, max_blocks_per_req=2, staged=staged)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=10))
    check(builder, [ScheduledRequest(a, 12, [1, 2, 3], [], 0)])
    c = Request("c", list(range(5)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="block_ids of request 'c' cover 4 tokens"):
        builder.build([ScheduledRequest(c, 5, [9], [], 1)])  # reuses a's row: 9, 2, 3
    wide = Request("w", list(range(40)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="block_ids of request 'w'"):
        builder.build([ScheduledRequest(wide, 40, [4, 5], [], 2)])
    check(builder, [ScheduledRequest(c, 5, [9, 10], [], 1)])  # still usable afterwards


@pytest.mark.parametrize("staged", [False, True])
def test_request_listed_twice_gets_two_rows(staged: bool) -> None:
    """The same request twice in one step (the builder must not share or clobber its row),
    then alone again, then with its table replaced under a new epoch."""
    builder = InputBuilder(torch.device("cpu"), BS, max_blocks_per_req=1, staged=staged)
    a = Request("a", list(range(12)), SamplingParams(max_tokens=10))
    b = Request("b", list(range(6)), SamplingParams(max_tokens=10))
    check(builder, [ScheduledRequest(a, 12, [1, 2, 3], [], 0), ScheduledRequest(b, 6, [4, 5])])
    a.num_computed_tokens = 11
    twice = [ScheduledRequest(a, 1, [1, 2, 3], [], 0), ScheduledRequest(a, 1, [1, 2, 3], [], 0)]
    check(builder, [*twice, ScheduledRequest(b, 6, [4, 5])])
    check(builder, [ScheduledRequest(a, 1, [1, 2, 3, 6], [], 0)])
    check(builder, [ScheduledRequest(a, 1, [7, 8, 9], [], 3), ScheduledRequest(b, 6, [4, 5])])
