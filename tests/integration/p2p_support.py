"""Drive ``tests.integration.p2p_worker`` children: each is one side of a p2p transfer in its
own interpreter (real sockets, a real gloo/NCCL pair), commanded over JSON lines.

Usable without pytest (the GPU test and the benchmark run as plain scripts too).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LAYOUT = {
    "version": 1,
    "dtype": "float32",
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
}


def block_hashes(tag: str, n: int) -> list[str]:
    """``n`` distinct, deterministic block hashes (hex) standing for one prompt's blocks."""
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class Worker:
    """One ``p2p_worker`` child. ``call`` sends a command and waits for its reply line."""

    def __init__(self, log_dir: Path, name: str, **config: Any) -> None:
        cfg = {"seed": 0, "num_blocks": 32, "layout": LAYOUT, "timeout_s": 10.0, **config}
        self.config = cfg
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        # The repository first; what the caller had after it (a carried NIXL on the GPU).
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env.update(PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.p2p_worker", json.dumps(cfg)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = str(self.reply(120.0)["address"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode())
        self._lines.put(None)

    def send(self, cmd: str, **args: Any) -> None:
        """Send a command without waiting (collect its answer with ``reply``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no reply within {timeout} s:\n{self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"worker exited ({self.proc.poll()}):\n{self.log_tail()}")
        return dict(json.loads(line))

    def call(self, cmd: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.reply(timeout)

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("quit")
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    # -- the two roles -------------------------------------------------------------------------
    def offer(self, request_id: str, block_ids: list[int]) -> dict[str, Any]:
        hashes = block_hashes(request_id, len(block_ids))
        return self.call("offer", request_id=request_id, block_ids=block_ids, hashes=hashes)

    def pull_args(
        self,
        source: Worker,
        offer: dict[str, Any],
        request_id: str,
        src_ids: list[int],
        dst_ids: list[int],
        **extra: Any,
    ) -> dict[str, Any]:
        """The ``pull`` command that loads ``src_ids`` of ``source`` (offered under
        ``request_id``) into ``dst_ids`` here, checked against the source's seed."""
        return {
            "request_id": request_id,
            "address": offer["address"],
            "transfer_id": offer["transfer_id"],
            "block_ids": dst_ids,
            "hashes": block_hashes(request_id, len(dst_ids)),
            "src_seed": source.config["seed"],
            "src_blocks": source.config["num_blocks"],
            "src_ids": src_ids,
            **extra,
        }


def wait_for(path: Path, timeout: float) -> None:
    """Until ``path`` exists (a worker's fault-injection marker)."""
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)
