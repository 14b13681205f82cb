"""The tensor-parallel KV handoff (``kv_store/tp_connector.py``, ``kv_store/tp_worker.py``):
keys per rank, the handle's per-rank p2p fields, how the ranks' results merge, the wire
form of a transfer, the refusal of a connector that cannot run on every rank, and rank 0's
fan-out driving a worker rank's end over an in-process channel (the executor's channel
between processes is ``tests/integration/test_tp_pd.py``'s)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.config import EngineConfig
from engine.kv.fingerprint import model_fingerprint, tensor_parallel_size_of
from engine.llm_engine import LLMEngine
from kv_store.base import KvLayout, KVTransfer, TransferResult
from kv_store.block_connector import BlockStoreConnector
from kv_store.factory import KVStoreSettings, across_ranks, build_connector, rank_worker
from kv_store.fs_backend import FsBackend
from kv_store.keys import block_keys
from kv_store.tp_connector import (
    merge_results,
    rank_fingerprint,
    split_ranks,
    transfer_from_json,
    transfer_to_json,
)


def test_fingerprint_names_the_size_and_records_name_the_rank(tiny_model_dir: Path) -> None:
    one = model_fingerprint(EngineConfig(model=str(tiny_model_dir)))
    two = model_fingerprint(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2))
    assert "-tp" not in one and two.endswith("-tp2") and two[:32] == one[:32]
    assert (tensor_parallel_size_of(one), tensor_parallel_size_of(two)) == (1, 2)
    assert rank_fingerprint(one, 0, 1) == one  # N = 1 keys are unchanged
    assert [rank_fingerprint(two, r, 2) for r in (0, 1)] == [f"{two}-r0", f"{two}-r1"]


def test_split_ranks_needs_one_entry_per_rank() -> None:
    assert split_ranks("h:1,h:2", 2) == ["h:1", "h:2"]
    assert split_ranks("h:1", 2) is None and split_ranks("h:1,h:2", 1) is None
    assert split_ranks("", 2) is None


def test_a_load_counts_what_every_rank_loaded() -> None:
    full = TransferResult("r", "load", True, num_loaded_blocks=3, bytes_moved=30)
    short = TransferResult("r", "load", False, num_loaded_blocks=1, bytes_moved=10)
    short.failure_reason, short.error = "missing", "block x missing"
    merged = merge_results("load", [full, short])
    assert (merged.ok, merged.num_loaded_blocks, merged.bytes_moved) == (False, 1, 40)
    assert merged.failure_reason == "missing" and merged.error == "rank 1: block x missing"
    assert merge_results("load", [full, full]).ok


def test_a_save_is_held_only_when_every_rank_holds_it() -> None:
    parts = []
    for rank in range(2):
        r = TransferResult("r", "save", True, held=True)
        r.transfer_id, r.source_address = f"r.{rank}", f"h:{5557 + rank}"
        parts.append(r)
    held = merge_results("save", parts)
    assert held.held and held.transfer_id == "r.0,r.1" and held.source_address == "h:5557,h:5558"
    parts[1].ok = False
    failed = merge_results("save", parts)
    assert not failed.ok and not failed.held and failed.transfer_id == ""


def test_transfer_survives_the_wire() -> None:
    t = KVTransfer("r", [1, 2, 3], [b"\x00\xff", b"\x10"], [4, 5], [16, 3], 1, "h:1,h:2", "a,b")
    assert transfer_from_json(transfer_to_json(t)) == t


def test_connector_without_rank_spec_is_refused_before_any_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    bare = BlockStoreConnector(FsBackend(str(tmp_path)), name="fs")  # built without a recipe
    config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cannot serve tensor_parallel_size > 1"):
        LLMEngine(config, bare)
    built = build_connector(KVStoreSettings(connector="fs", kv_path=str(tmp_path)))
    assert built is not None and built.rank_spec is not None
    assert built.rank_spec["settings"]["kv_path"] == str(tmp_path)


# -- rank 0's fan-out and a worker rank's end, joined in one process --------------------------
BS = 16
LAYOUT = KvLayout(
    version=1, dtype="float32", block_size=BS, num_layers=2, num_kv_heads=2, head_dim=8
)
FINGERPRINT = "m" * 32 + "-tp2"


class LoopbackRanks:
    """A ``RankChannel`` of two ranks in one process: rank 0's messages go straight to rank
    1's ``TPRankWorker`` with that rank's cache; replies and results come back in order."""

    size = 2

    def __init__(self, cache: torch.Tensor) -> None:
        self.worker, self.cache = rank_worker(1), cache
        self._replies: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        # Through JSON, as between processes: nothing may ride along that does not survive it.
        self._replies += self.worker.handle(json.loads(json.dumps(message)), self.cache)

    def receive(self) -> list[tuple[int, dict[str, Any]]]:
        out, self._replies = self._replies + self.worker.poll(), []
        return [(1, json.loads(json.dumps(m))) for m in out]


def _cache(seed: int | None) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, 8, BS, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class Ranks:
    """Rank 0's connector as the factory builds it, its fan-out over ``LoopbackRanks`` and
    the two ranks' caches (bound)."""

    def __init__(self, kv_path: Path, seeds: tuple[int | None, int | None]) -> None:
        built = build_connector(KVStoreSettings(connector="fs", kv_path=str(kv_path)))
        assert built is not None
        self.connector, self.cache0 = built, _cache(seeds[0])
        self.channel = LoopbackRanks(_cache(seeds[1]))
        self.fanout = across_ranks(built, self.channel, timeout_s=10.0)
        self.fanout.bind_kv_cache(self.cache0, LAYOUT, FINGERPRINT)

    def finished(self, timeout_s: float = 20.0) -> TransferResult:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.fanout.poll()
            if done:
                assert len(done) == 1, done
                return done[0]
            time.sleep(0.005)
        raise AssertionError("no merged result within the deadline")


def test_every_rank_moves_its_own_shard(tmp_path: Path) -> None:
    tokens = list(range(3 * BS))
    hashes = compute_block_hashes(tokens, BS, include_partial=True)
    ids = [2, 5, 7]
    src = Ranks(tmp_path, (1, 2))
    try:
        src.fanout.start_save(KVTransfer("s", tokens, hashes, ids, [BS] * 3))
        saved = src.finished()
        assert saved.ok and saved.kind == "save" and len(saved.keys) == 3
        assert src.connector.lookup(tokens, hashes) == 3  # the scheduler side: rank 0's view
    finally:
        src.fanout.close()
    # One record per block per rank, each under its rank's own fingerprint.
    store = FsBackend(str(tmp_path))
    per_rank = [block_keys(rank_fingerprint(FINGERPRINT, r, 2), hashes) for r in (0, 1)]
    assert all(store.exists(keys) == [True] * 3 for keys in per_rank)
    dst = Ranks(tmp_path, (None, None))
    try:
        dst.fanout.start_load(KVTransfer("d", tokens, hashes, [0, 1, 3], [BS] * 3))
        loaded = dst.finished()
        assert loaded.ok and loaded.num_loaded_blocks == 3
        for a, b in ((src.cache0, dst.cache0), (src.channel.cache, dst.channel.cache)):
            assert torch.equal(b[:, :, [0, 1, 3]], a[:, :, ids])
        assert not torch.equal(dst.cache0[:, :, 0], dst.channel.cache[:, :, 0])  # two shards
        # A block rank 1 lacks is missing for the engine: it recomputes it on every rank.
        store.delete([per_rank[1][1]])
        dst.fanout.start_load(KVTransfer("e", tokens, hashes, [4, 5, 6], [BS] * 3))
        short = dst.finished()
        assert short.num_loaded_blocks == 1 and not short.ok
        assert short.failure_reason == "missing" and str(short.error).startswith("rank 1:")
    finally:
        dst.fanout.close()
    assert dst.channel.worker.poll() == []  # rank 0's close reached rank 1: nothing bound


def test_a_worker_rank_refuses_messages_before_bind() -> None:
    worker = rank_worker(1)
    with pytest.raises(RuntimeError, match="before the connector was bound"):
        worker.handle({"op": "release", "request_id": "r"}, _cache(None))
    bad = {"op": "bind", "spec": {"settings": {"connector": "nope"}, "host": "h"}}
    (reply,) = worker.handle({**bad, "fingerprint": FINGERPRINT, "size": 2}, _cache(None))
    assert reply["op"] == "bound" and not reply["ok"] and "connector" in reply["error"]
    assert worker.poll() == []
