"""``--connector p2p --kv-store fs``: the handoff goes peer to peer, the store gets a copy.

The producer's blocks stay allocated until both the pull (or the lease's end) and the store
write are done; a consumer whose pull finds nothing (here: the producer aborted the hold)
loads the blocks from the store instead of recomputing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kv_store.factory import KVStoreSettings, build_connector
from kv_store.p2p import P2PStats
from tests.integration.test_engine_kv import PROMPT, _colocated
from tests.integration.test_p2p_engine import consume, producer  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(300)


def composed(kv_dir: Path) -> Any:
    settings = KVStoreSettings("p2p", kv_path=str(kv_dir), kv_store="fs", p2p_timeout_s=20.0)
    return build_connector(settings)


def test_pull_and_store_copy(producer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    p = producer(kv_store="fs", kv_path=str(tmp_path))
    handle = p.next()
    assert handle["held"] and len(handle["keys"]) == 3  # the store's keys ride along
    tokens, engine, error = consume(tiny_model_dir, handle, connector=composed(tmp_path))
    assert error is None and tokens == _colocated(tiny_model_dir, PROMPT)
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 3
    done = p.next(60)
    assert done["free_blocks"] == done["total_blocks"]
    assert done["p2p"]["lease_ends"] == {"pulled": 1}
    transport = engine.stats().transport  # the p2p figures, handed on by the engine
    assert isinstance(transport, P2PStats) and transport.bytes_received > 0
    assert sum(1 for f in tmp_path.rglob("*") if f.is_file()) >= 3  # the store copy


def test_store_is_the_fallback(producer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    p = producer(kv_store="fs", kv_path=str(tmp_path))
    handle = p.next()
    p.send("abort")  # the hold ends before any pull: p2p has nothing to give
    done = p.next(60)
    assert done["free_blocks"] == done["total_blocks"]
    assert done["p2p"]["lease_ends"] == {"aborted": 1}
    tokens, engine, error = consume(tiny_model_dir, handle, connector=composed(tmp_path))
    assert error is None and tokens == _colocated(tiny_model_dir, PROMPT)
    assert engine.transfers is not None
    assert engine.transfers.stats.blocks_loaded == 3  # from the store
    assert engine.transfers.stats.blocks_recomputed == 0
