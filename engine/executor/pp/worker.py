"""A pipeline-parallel process other than rank 0: ``python -m engine.executor.pp.worker``.

Started by rank 0 (``engine/executor/pp/executor.py``) with one JSON line of settings on
stdin (the tensor-parallel worker's, plus its stage and TP rank), then step headers
(``engine/executor/tp/step_wire.py``), each followed by the step's packed inputs. It joins
its stage's tensor-parallel group and the grid's group, builds a runner of its stage's
layers (and their KV only), and for every step: receives the hidden states from the same
TP rank of the previous stage (stage > 0), runs its layers, and sends the result on (to
the next stage, or, from the last stage's TP rank 0, the logits to rank 0). Every receive
and send waits at most ``distributed_timeout``. It exits as a tensor-parallel worker does:
on a shutdown header, on EOF, on a failed or timed-out receive, send or collective, and
when its parent changes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.pp_group import PPGroup, hidden_tag, logits_tag
from engine.distributed.tp_group import TPGroup, startup_timeout, timedelta, use_gloo_host
from engine.executor.model_runner import ModelRunner
from engine.executor.pp.executor import stage_store
from engine.executor.tp.executor import UP_KEY
from engine.executor.tp.worker import _watch_parent, exit_with, step_messages
from engine.kv.tp import WorkerKV
from engine.models import ModelArgs

logger = logging.getLogger("engine.executor.pp.worker")


def serve_stage(
    runner: ModelRunner, pp: PPGroup, stream: BinaryIO, kv: WorkerKV | None = None
) -> None:
    """Run this stage's part of every step rank 0 announces, until shutdown or EOF.
    KV-connector messages go to ``kv``: this process moves its stage's layers of its TP
    rank's heads (docs/design.md §3, "KV with pipeline parallelism")."""
    sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
    hidden = runner.args.hidden_size
    for header, host in step_messages(stream, kv):
        inputs = runner.to_device(host)
        carried = None
        if pp.stage > 0:
            shape = (2, header.num_tokens, hidden)
            carried = torch.empty(shape, dtype=runner.dtype, device=runner.device)
            src = pp.peer(pp.stage - 1)
            pp.wait(pp.recv(carried, src, hidden_tag(header.seq)), "receive of hidden states")
        out = runner.run_stage(inputs, carried).contiguous()
        if not pp.is_last:
            sends.append((pp.send(out, pp.peer(pp.stage + 1), hidden_tag(header.seq)), out))
        elif pp.tp_rank == 0:  # every TP rank of the last stage holds the full logits
            sends.append((pp.send(out, 0, logits_tag(header.seq), logits=True), out))
        while len(sends) > pp.pp_size:  # bounded: at most P steps in flight
            pp.wait(sends.popleft()[0], "send")


def main() -> int:
    stream = sys.stdin.buffer
    spec = json.loads(stream.readline())
    stage, tp_rank = int(spec["stage"]), int(spec["tp_rank"])
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[pp stage {stage} rank {tp_rank}] %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent(int(spec["parent_pid"]))
    return run_worker(spec, stream)


def run_worker(
    spec: dict[str, Any],
    stream: BinaryIO,
    *,
    store_host: str = "127.0.0.1",
    kv_host: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Join the grid under rank 0's store at ``store_host`` and serve ``stream`` until it
    ends. A stage on another host (engine/executor/pp/join.py) passes the leader's address,
    its own ``kv_host`` (where its p2p KV is pulled from) and ``on_ready`` (called once the
    groups are formed and the runner is built)."""
    rank, stage, tp_rank = int(spec["rank"]), int(spec["stage"]), int(spec["tp_rank"])
    pp_size, tp_size = int(spec["pp_size"]), int(spec["tp_size"])
    if spec.get("gloo_host"):
        use_gloo_host(str(spec["gloo_host"]))
    torch.set_num_threads(int(spec["torch_threads"]))
    config = EngineConfig(**spec["config"])
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = config.distributed_timeout
    store = dist.TCPStore(
        store_host,
        int(spec["store_port"]),
        None,
        False,
        timedelta(startup_timeout(timeout)),
        use_libuv=True,
    )
    store.set(UP_KEY.format(rank=rank), str(os.getpid()))
    # The same order as rank 0 (PipelineExecutor._build): the stage's group, the grid's.
    tp = TPGroup.single()
    if tp_size > 1:
        tp = TPGroup.create(stage_store(store, stage), tp_rank, tp_size, device, timeout)
    pp = PPGroup.create(store, stage, tp_rank, pp_size, tp_size, device, timeout)
    args = ModelArgs.from_hf(config.hf_config())
    runner = ModelRunner(config, args, int(spec["max_model_len"]), tp, pp)
    kv = WorkerKV(runner, rank, int(spec["store_port"]), timeout, store_host, kv_host)
    if on_ready is not None:
        on_ready()
    try:
        serve_stage(runner, pp, stream, kv)
    finally:
        kv.close()  # p2p: end this process's leases, stop its server
    return 0


if __name__ == "__main__":
    exit_with(main, logger, "pipeline-parallel worker")
