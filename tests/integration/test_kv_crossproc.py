"""Cross-process: one process saves blocks, another loads them, bit-exact — per backend.

Both sides are fresh interpreters (``python -m tests.integration.test_kv_crossproc``) with
``PYTHONHASHSEED=0`` (required by LMCache), rebuilding the same source cache from a seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.integration.test_kv_contract import (
    REPO,
    Target,
    layout,
    one,
    prompt,
    random_cache,
    transfer,
)

SEED = 31
SRC_IDS, DST_IDS = [1, 3, 5], [0, 2, 4]


def _child(role: str, kind: str, location: str, fingerprint: str) -> dict[str, object]:
    torch.set_num_threads(1)
    lay = layout("bfloat16")
    src = random_cache(lay, 8, seed=SEED)
    tokens = prompt(SEED, 2 * 16 + 5)
    t = Target(kind, location, fingerprint=fingerprint)
    try:
        if role == "save":
            conn = t.connector(src, lay)
            conn.start_save(transfer("r", tokens, SRC_IDS))
            r = one(conn)
            return {"ok": r.ok, "saved": r.num_saved_blocks, "reason": r.failure_reason}
        dst = torch.zeros_like(src)
        conn = t.connector(dst, lay)
        held = conn.lookup(tokens, transfer("q", tokens, DST_IDS).block_hashes)
        conn.start_load(transfer("r", tokens, DST_IDS))
        r = one(conn)
        equal = all(
            torch.equal(dst[:, :, d, :n].view(torch.int16), src[:, :, s, :n].view(torch.int16))
            for s, d, n in zip(SRC_IDS, DST_IDS, [16, 16, 5], strict=True)
        )
        return {
            "ok": r.ok,
            "loaded": r.num_loaded_blocks,
            "lookup": held,
            "equal": equal,
            "reason": r.failure_reason,
        }
    finally:
        t.close()


def _run(role: str, kind: str, location: str, fingerprint: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.test_kv_crossproc",
        role,
        kind,
        location,
        fingerprint,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["fs", "redis", "lmcache"])
def test_save_in_one_process_load_in_another(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    location = {
        "fs": lambda: str(tmp_path / "kv"),
        "redis": lambda: request.getfixturevalue("redis_server"),
        "lmcache": lambda: request.getfixturevalue("lmcache_server"),
    }[kind]()
    fp = uuid.uuid4().hex[:16]
    saved = _run("save", kind, location, fp)
    assert saved == {"ok": True, "saved": 3, "reason": None}, saved
    loaded = _run("load", kind, location, fp)
    assert loaded == {"ok": True, "loaded": 3, "lookup": 3, "equal": True, "reason": None}, loaded


if __name__ == "__main__":
    print(json.dumps(_child(*sys.argv[1:5])))
