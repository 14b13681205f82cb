"""Pipeline parallelism on the CPU (gloo): throughput of P = 2 against P = 1 with the
in-flight batches on and off (off shows the bubble), and the per-step handoff between
stages.

Throughput: ``--batch`` requests of ``--input-len`` random tokens, ``--output-len``
tokens each (greedy, EOS ignored), all added at once and run to the end through
``LLMEngine.step``; output tokens per second of wall time. The machine's cores are split
evenly between the stages' processes (``--threads`` in all: P = 1 gets them all, each of
P = 2's processes half), so every run uses the same CPU. Dummy weights from a config
directory (default: an 8-layer, hidden-512 Llama written to a temporary directory).

Handoff: two processes in a pipeline group (``engine/distributed/pp_group.py``) bounce a
``[2, tokens, hidden]`` float32 tensor (what a stage sends: the hidden states and the
residual) back and forth; half the round trip is one handoff. Also the engine's view:
rank 0's mean wait for a step's logits (``HandoffStats``).

    python -m benchmarks.engine.pipeline_parallel --threads 1
    two GPUs (NCCL): python3 -m benchmarks.engine.pipeline_parallel --device cuda \
        --model benchmarks/configs/llama-3.1-8b --output-json \
        benchmarks/results/engine/pipeline_parallel_cuda.json

Writes ``benchmarks/results/engine/pipeline_parallel.json`` (with the command) and prints
the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.record import recorded_command, result_path

MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}


def throughput(model: str, pp: int, inflight: bool, args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(max(1, args.threads // pp))  # the workers take the same count
    cfg = EngineConfig(
        model=model,
        load_format="dummy",
        device=args.device,
        dtype="float32" if args.device == "cpu" else "bfloat16",
        pipeline_parallel_size=pp,
        pipeline_inflight_batches=inflight,
        max_num_seqs=args.batch,
        num_kv_blocks=args.batch * (-(-(args.input_len + args.output_len) // 16) + 1) + 8
        if args.device == "cpu"
        else None,
        max_model_len=args.input_len + args.output_len + 8,
    )
    engine = LLMEngine(cfg)
    try:
        rng = random.Random(0)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        # A throwaway batch first: the first steps of a process pay one-time costs.
        for i in range(args.batch):
            engine.add_request(f"w{i}", [rng.randrange(3, 8000) for _ in range(8)], params)
        while engine.has_unfinished():
            engine.step()
        engine.reset_prefix_cache()
        if engine.batches is not None:
            engine.batches.max_in_flight = 0
        handoff = getattr(engine.executor, "handoff", None)
        if handoff is not None:
            handoff.steps, handoff.wait_seconds = 0, 0.0
        start = time.perf_counter()
        for i in range(args.batch):
            prompt = [rng.randrange(3, 8000) for _ in range(args.input_len)]
            engine.add_request(f"r{i}", prompt, params)
        tokens = steps = 0
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
        seconds = time.perf_counter() - start
        return {
            "pp": pp,
            "inflight_batches": inflight and pp > 1,
            "threads_per_process": torch.get_num_threads(),
            "output_tokens": tokens,
            "seconds": seconds,
            "output_tok_per_s": tokens / seconds,
            "engine_steps": steps,
            "max_in_flight": engine.batches.max_in_flight if engine.batches is not None else 1,
            "logits_wait_us_mean": handoff.mean_wait_us if handoff else 0.0,
        }
    finally:
        engine.shutdown()


def _group(rank: int, port: int, timeout_s: float, device: str) -> Any:
    from engine.distributed.pp_group import PPGroup

    dev = torch.device("cpu" if device == "cpu" else f"cuda:{rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta_s(60), use_libuv=True)
    return store, PPGroup.create(store, rank, 0, 2, 1, dev, timeout_s)


def timedelta_s(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def bounce(pp: Any, shape: tuple[int, ...], repeats: int, first: bool) -> float:
    """Round trips of a ``shape`` tensor between the two ranks; the median one-way seconds."""
    t = torch.zeros(shape, device="cuda" if pp.nccl else "cpu")
    times = []
    other = 1 - pp.rank
    for i in range(repeats + 2):
        start = time.perf_counter()
        if first:
            pp.wait(pp.send(t, other, 2 * i), "send")
            pp.wait(pp.recv(t, other, 2 * i + 1), "recv")
        else:
            pp.wait(pp.recv(t, other, 2 * i), "recv")
            pp.wait(pp.send(t, other, 2 * i + 1), "send")
        if pp.nccl:
            torch.cuda.synchronize()
        if i >= 2:  # the first two connect and warm up
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def handoff(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rank 0 here, rank 1 a child process (``--peer``) running the same bounces."""
    from pdserve.procs import free_ports

    port = free_ports(1)[0]
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "benchmarks.engine.pipeline_parallel", "--peer", str(port)]
    cmd += ["--hidden", *map(str, args.hidden), "--tokens", *map(str, args.tokens)]
    cmd += ["--device", args.device]
    peer = subprocess.Popen(cmd + ["--repeats", str(args.repeats)], env=env)
    try:
        _store, pp = _group(0, port, 60.0, args.device)
        rows = []
        for hidden in args.hidden:
            for tokens in args.tokens:
                shape = (2, tokens, hidden)
                seconds = bounce(pp, shape, args.repeats, True)
                nbytes = 4 * 2 * tokens * hidden
                rows.append(
                    {
                        "hidden": hidden,
                        "tokens": tokens,
                        "bytes": nbytes,
                        "one_way_us": 1e6 * seconds,
                        "gb_per_s": nbytes / seconds / 1e9,
                    }
                )
        pp.close()
        return rows
    finally:
        peer.wait(60)


def run_peer(args: argparse.Namespace) -> None:
    _store, pp = _group(1, args.peer, 60.0, args.device)
    for hidden in args.hidden:
        for tokens in args.tokens:
            bounce(pp, (2, tokens, hidden), args.repeats, False)
    pp.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="config dir (dummy weights); default: small")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, two GPUs)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.peer is not None:
        run_peer(args)
        return
    command = recorded_command("benchmarks.engine.pipeline_parallel")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = tmp
            (Path(tmp) / "config.json").write_text(json.dumps(MODEL))
        runs = [(1, True), (2, False), (2, True)]
        # Each configuration --rounds times, the configurations alternating (a shared
        # machine's load drifts); the median round of each is reported.
        rounds = [[throughput(model, pp, f, args) for pp, f in runs] for _ in range(args.rounds)]
        rows = []
        for k in range(len(runs)):
            mine = sorted((r[k] for r in rounds), key=lambda r: r["output_tok_per_s"])
            rows.append(
                mine[len(mine) // 2] | {"rounds_tok_per_s": [r["output_tok_per_s"] for r in mine]}
            )
    sends = handoff(args)
    base = rows[0]["output_tok_per_s"]
    print(f"{'P':>2} {'in flight':>9} {'tok/s':>8} {'vs P=1':>7} {'steps':>6} {'wait us':>8}")
    for r in rows:
        print(
            f"{r['pp']:>2} {r['max_in_flight']:>9} {r['output_tok_per_s']:>8.1f} "
            f"{r['output_tok_per_s'] / base:>6.2f}x {r['engine_steps']:>6} "
            f"{r['logits_wait_us_mean']:>8.0f}"
        )
    print(f"\n{'hidden':>6} {'tokens':>6} {'bytes':>9} {'one-way us':>10} {'GB/s':>6}")
    for s in sends:
        print(
            f"{s['hidden']:>6} {s['tokens']:>6} {s['bytes']:>9} {s['one_way_us']:>10.1f} "
            f"{s['gb_per_s']:>6.2f}"
        )
    out = Path(args.output_json or result_path("engine", "pipeline_parallel.json"))
    record = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "args": vars(args),
        "throughput": rows,
        "handoff": sends,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
