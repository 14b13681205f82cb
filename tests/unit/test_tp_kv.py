"""The pure parts of the tensor-parallel KV handoff (``kv_store/tp_connector.py``): keys per
rank, the handle's per-rank p2p fields, how the ranks' results merge, the wire form of a
transfer; and the refusal of a connector that cannot run on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.fingerprint import model_fingerprint, tensor_parallel_size_of
from engine.llm_engine import LLMEngine
from kv_store.base import KVTransfer, TransferResult
from kv_store.block_connector import BlockStoreConnector
from kv_store.factory import KVStoreSettings, build_connector
from kv_store.fs_backend import FsBackend
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
    assert "-tp" not in one and two.endswith("-tp2") and two[:32] != one[:32]
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


def test_connector_without_worker_recipe_is_refused_before_any_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    bare = BlockStoreConnector(FsBackend(str(tmp_path)), name="fs")  # built without a recipe
    config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cannot serve tensor_parallel_size > 1"):
        LLMEngine(config, bare)
    built = build_connector(KVStoreSettings(connector="fs", kv_path=str(tmp_path)))
    assert built is not None and built.worker_recipe is not None
    assert built.worker_recipe["settings"]["kv_path"] == str(tmp_path)
