"""A tensor-parallel worker rank (1..N-1): ``python -m engine.executor.tp.worker``, started by rank 0.

stdin carries one JSON line of settings (``MultiprocExecutor._spawn``), then step headers
(``engine/executor/tp/step_wire.py``), each followed on the pipe by its packed step inputs. The worker
joins the group, builds its ``ModelRunner`` (its shard, its KV heads' cache), and then, for
every header, reads the inputs (and, under async scheduling, receives the token ids by a
device broadcast) and runs the forward pass with the other ranks. It exits on a shutdown header, on EOF
(rank 0 closed the pipe or died), when a collective fails or times out, and when its parent
changes (a watchdog thread: rank 0 died without the pipe closing, e.g. a forked child of
rank 0 still holds the pipe's write end).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.tp_group import TPGroup, startup_timeout, timedelta
from engine.executor.model_runner import ModelRunner
from engine.executor.step_inputs import HostInputs
from engine.executor.tp.executor import UP_KEY
from engine.executor.tp.step_wire import HEADER_SIZE, OP_KV, OP_SHUTDOWN, Header, unpack
from engine.kv.tp import WorkerKV
from engine.models import ModelArgs

logger = logging.getLogger("engine.executor.tp.worker")


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(3)  # rank 0 is gone: nothing more will come

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF."""
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def step_messages(stream: BinaryIO, kv: WorkerKV | None) -> Iterator[tuple[Header, HostInputs]]:
    """Each step rank 0 announces on ``stream``: its header and unpacked host inputs, until
    a shutdown header or EOF. KV-connector messages in between go to ``kv``
    (``engine/kv/tp.py``). Shared by the tensor- and pipeline-parallel workers."""
    while True:
        data = _read_exact(stream, HEADER_SIZE)
        if data is None:
            return
        header = Header.decode(data)
        if header.op == OP_SHUTDOWN:
            return
        if header.op == OP_KV:
            payload = _read_exact(stream, header.num_ids)
            if payload is None:
                return
            if kv is None:
                raise RuntimeError("a KV message reached a worker without KV support")
            kv.handle(payload)
            continue
        payload = _read_exact(stream, 8 * header.buffer_len)  # the packed int64 inputs
        if payload is None:
            return
        yield header, unpack(header, np.frombuffer(bytearray(payload), dtype=np.int64))


def serve(runner: ModelRunner, tp: TPGroup, stream: BinaryIO, kv: WorkerKV | None = None) -> None:
    """Run steps as rank 0 announces them, until a shutdown header or EOF."""
    for header, host in step_messages(stream, kv):
        ids = None
        if header.ids_on_device:
            ids = torch.empty(header.num_tokens, dtype=torch.int64, device=runner.device)
            tp.broadcast(ids, host=False)
        runner.run(runner.to_device(host, ids))


def main() -> int:
    stream = sys.stdin.buffer
    spec = json.loads(stream.readline())
    rank, size = int(spec["rank"]), int(spec["size"])
    logging.basicConfig(
        level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s"
    )
    _watch_parent(int(spec["parent_pid"]))
    torch.set_num_threads(int(spec["torch_threads"]))
    config = EngineConfig(**spec["config"])
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = config.distributed_timeout
    store = dist.TCPStore(
        "127.0.0.1",
        int(spec["store_port"]),
        None,
        False,
        timedelta(startup_timeout(timeout)),
        use_libuv=True,
    )
    store.set(UP_KEY.format(rank=rank), str(os.getpid()))
    tp = TPGroup.create(store, rank, size, device, timeout)
    args = ModelArgs.from_hf(config.hf_config())
    runner = ModelRunner(config, args, int(spec["max_model_len"]), tp)
    kv = WorkerKV(runner, rank, int(spec["store_port"]), timeout)
    try:
        serve(runner, tp, stream, kv)
    finally:
        kv.close()  # p2p: end this rank's leases, stop its server
    return 0


def exit_with(main: Callable[[], int], log: logging.Logger, what: str) -> NoReturn:
    """Run a worker process's ``main`` and end the process with its status (1 after
    logging an exception), without interpreter teardown: destroying a process group whose
    peers are gone can block."""
    try:
        code = main()
    except Exception:
        log.exception("%s failed", what)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_with(main, logger, "tensor-parallel worker")
