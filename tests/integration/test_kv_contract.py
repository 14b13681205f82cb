"""One contract suite for every KV connector (fs, redis, lmcache) and backend (fs, redis).

Each case is a plain function taking a ``Target`` (how to build a connector for a fresh
cache). fs and redis cases run in the pytest process. LMCache keys chunks by Python
``hash()``, so its cases must run with ``PYTHONHASHSEED=0``: one subprocess runs them all
(``python -m tests.integration.test_kv_contract cases lmcache URL``) and reports each
case's outcome; the parametrized tests assert on those outcomes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from common.block_hash import compute_block_hashes
from kv_store.base import KVConnector, KvLayout, KVTransfer, TransferResult
from kv_store.record import torch_dtype
from tests.servers import ManagedServer

BS = 16
REPO = Path(__file__).resolve().parents[2]


def layout(dtype: str = "float32") -> KvLayout:
    return KvLayout(version=1, dtype=dtype, block_size=BS, num_layers=2, num_kv_heads=2, head_dim=8)


def random_cache(lay: KvLayout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(shape, generator=g).to(torch_dtype(lay.dtype))


def transfer(rid: str, tokens: list[int], block_ids: list[int], start_block: int = 0) -> KVTransfer:
    hashes = compute_block_hashes(tokens, BS, include_partial=True)
    counts = [min(BS, len(tokens) - i * BS) for i in range(len(hashes))]
    assert len(block_ids) == len(hashes), (len(block_ids), len(hashes))
    return KVTransfer(rid, tokens, hashes, block_ids, counts, start_block)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n,), generator=g).tolist()


def one(conn: Any, timeout_s: float = 60.0) -> TransferResult:
    """The next finished transfer of ``conn`` (bounded wait)."""
    got = conn.wait(1, timeout_s)
    assert got, f"no transfer finished within {timeout_s} s"
    return got[0]


@dataclass
class Target:
    """Builds connectors that share one store; ``fingerprint`` isolates this run's keys."""

    kind: str
    location: str
    ttl: float | None = None
    fingerprint: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    made: list[KVConnector] = field(default_factory=list)

    def connector(self, cache: torch.Tensor, lay: KvLayout) -> Any:
        from kv_store.factory import KVStoreSettings, build_connector

        s = KVStoreSettings(connector=self.kind, kv_ttl=self.ttl or 0, kv_capacity=0)
        if self.kind == "fs":
            s.kv_path = self.location
        elif self.kind == "redis":
            s.redis_url = self.location
        else:
            s.lmcache_url, s.kv_capacity = self.location, 64 << 20
        conn = build_connector(s)
        assert conn is not None
        conn.bind_kv_cache(cache, lay, self.fingerprint)
        self.made.append(conn)
        return conn

    def close(self) -> None:
        for c in self.made:
            c.close()


# -- cases ----------------------------------------------------------------------------------


def case_roundtrip(t: Target, dtype: str = "float32") -> None:
    """Save from one cache, load into a zeroed cache at other block ids: bit-exact,
    including the partial tail block."""
    lay = layout(dtype)
    src = random_cache(lay, 10, seed=1)
    tokens = prompt(1, 2 * BS + 8)  # two full blocks and an 8-token tail
    a = t.connector(src, lay)
    a.start_save(transfer("r1", tokens, [5, 2, 7]))
    r = one(a)
    assert r.ok and r.kind == "save" and len(r.keys) == 3, r
    assert a.stats().blocks_saved == 3
    dst = torch.zeros_like(src)
    b = t.connector(dst, lay)
    assert b.lookup(tokens, transfer("q", tokens, [0, 1, 3]).block_hashes) == 3
    b.start_load(transfer("r1", tokens, [0, 1, 3]))
    r = one(b)
    assert r.ok and r.num_loaded_blocks == 3 and r.failure_reason is None, r
    assert torch.equal(dst[:, :, 0], src[:, :, 5]) and torch.equal(dst[:, :, 1], src[:, :, 2])
    assert torch.equal(dst[:, :, 3, :8], src[:, :, 7, :8])
    assert not dst[:, :, 3, 8:].any(), "a partial load must not write past the block's tokens"
    assert not dst[:, :, [2, 4, 5, 6, 7, 8, 9]].any(), "only the target blocks may change"
    assert b.stats().blocks_loaded == 3


def case_roundtrip_bf16(t: Target) -> None:
    case_roundtrip(t, "bfloat16")


def case_lookup_leading(t: Target) -> None:
    """lookup counts only the leading blocks the store holds."""
    lay = layout()
    src = random_cache(lay, 8, seed=2)
    tokens = prompt(2, 4 * BS)
    a = t.connector(src, lay)
    full = transfer("r", tokens, [0, 1, 2, 3])
    assert a.lookup(tokens, full.block_hashes) == 0
    a.start_save(transfer("r", tokens[: 2 * BS], [0, 1]))
    assert one(a).ok
    assert a.lookup(tokens, full.block_hashes) == 2
    assert a.lookup(prompt(3, 4 * BS), full.block_hashes[:0]) == 0
    other = prompt(3, 4 * BS)
    assert a.lookup(other, transfer("o", other, [0, 1, 2, 3]).block_hashes) == 0


def case_dedup(t: Target) -> None:
    """A second save of the same blocks writes nothing new; a longer prompt sharing the
    prefix writes only its new blocks."""
    lay = layout()
    src = random_cache(lay, 8, seed=4)
    tokens = prompt(4, 3 * BS)
    a = t.connector(src, lay)
    a.start_save(transfer("r", tokens, [0, 1, 2]))
    first = one(a)
    assert first.ok and first.bytes_moved > 0
    a.start_save(transfer("r", tokens, [0, 1, 2]))
    second = one(a)
    assert second.ok and second.bytes_moved == 0 and len(second.keys) == 3, second
    assert a.stats().blocks_saved == 3 and a.stats().blocks_skipped == 3
    longer = tokens + prompt(5, BS)
    a.start_save(transfer("r2", longer, [0, 1, 2, 3]))
    third = one(a)
    assert third.ok and 0 < third.bytes_moved < first.bytes_moved, (third, first)
    assert a.stats().blocks_saved == 4


def case_start_block(t: Target) -> None:
    """Only blocks ``start_block..`` move; a load with start_block skips the leading ones."""
    lay = layout()
    src = random_cache(lay, 8, seed=6)
    tokens = prompt(6, 3 * BS)
    a = t.connector(src, lay)
    a.start_save(transfer("r", tokens, [0, 1, 2]))
    assert one(a).ok
    dst = torch.zeros_like(src)
    b = t.connector(dst, lay)
    b.start_load(transfer("r", tokens, [4, 5, 6], start_block=1))
    r = one(b)
    assert r.ok and r.num_loaded_blocks == 2, r
    assert not dst[:, :, 4].any()
    assert torch.equal(dst[:, :, 5], src[:, :, 1]) and torch.equal(dst[:, :, 6], src[:, :, 2])


def case_missing_load(t: Target) -> None:
    """Loading blocks nobody saved reports 'missing' with zero blocks, and writes nothing."""
    lay = layout()
    dst = torch.zeros(lay.num_layers, 2, 4, BS, lay.num_kv_heads, lay.head_dim)
    b = t.connector(dst, lay)
    tokens = prompt(7, 2 * BS)
    b.start_load(transfer("r", tokens, [0, 1]))
    r = one(b)
    assert not r.ok and r.num_loaded_blocks == 0 and r.failure_reason == "missing", r
    assert not dst.any()


CASES: dict[str, Callable[[Target], None]] = {
    "roundtrip": case_roundtrip,
    "roundtrip_bf16": case_roundtrip_bf16,
    "lookup_leading": case_lookup_leading,
    "dedup": case_dedup,
    "start_block": case_start_block,
    "missing_load": case_missing_load,
}


def run_cases(kind: str, location: str) -> dict[str, str]:
    """Run every case against a fresh target; ``{case: "ok" | traceback}``."""
    out = {}
    for name, fn in CASES.items():
        tgt = Target(kind, location)
        try:
            fn(tgt)
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
        finally:
            tgt.close()
    return out


# -- pytest ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lmcache_results(lmcache_proc: ManagedServer) -> dict[str, str]:
    if lmcache_proc.proc is None or lmcache_proc.proc.poll() is not None:
        lmcache_proc.start()
    lmcache_server = f"lm://127.0.0.1:{lmcache_proc.port}"
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.test_kv_contract",
        "cases",
        "lmcache",
        lmcache_server,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lmcache case runner failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["fs", "redis", "lmcache"])
def test_connector_contract(
    kind: str, case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "lmcache":
        result = request.getfixturevalue("lmcache_results")[case]
        assert result == "ok", result
        return
    location = str(tmp_path / "kv") if kind == "fs" else request.getfixturevalue("redis_server")
    tgt = Target(kind, location)
    try:
        CASES[case](tgt)
    finally:
        tgt.close()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_ttl_expiry(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Blocks older than the TTL are missing for lookup and load."""
    location = str(tmp_path / "kv") if kind == "fs" else request.getfixturevalue("redis_server")
    tgt = Target(kind, location, ttl=1.0)
    try:
        lay = layout()
        src = random_cache(lay, 4, seed=8)
        tokens = prompt(8, 2 * BS)
        a = tgt.connector(src, lay)
        tr = transfer("r", tokens, [0, 1])
        a.start_save(tr)
        assert one(a).ok
        assert a.lookup(tokens, tr.block_hashes) == 2
        end = time.monotonic() + 10
        while a.lookup(tokens, tr.block_hashes) and time.monotonic() < end:
            time.sleep(0.2)
        assert a.lookup(tokens, tr.block_hashes) == 0, "blocks outlived their TTL"
        a.start_load(tr)
        r = one(a)
        assert not r.ok and r.failure_reason == "missing" and r.num_loaded_blocks == 0
    finally:
        tgt.close()


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "cases":
        torch.set_num_threads(1)
        print(json.dumps(run_cases(argv[1], argv[2])))
        return 0
    print(
        "usage: python -m tests.integration.test_kv_contract cases KIND LOCATION", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
