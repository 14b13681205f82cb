"""The P/D handoff as the decode side sees it: time added between token 1 and token 2.

A producer engine (its own process) prefills a long prompt with ``save_kv``; the consumer
engine (this process) takes the handle, loads the prompt's KV through the connector and
decodes. For each connector we report the KV load time the engine measured, the time from
handing the request to the consumer until token 2, and the consumer's steady inter-token
latency; "added" = token-2 time - ITL is what the handoff costs over a colocated step.

    python3 -m benchmarks.kv.p2p_handoff_gpu --connectors p2p,fs \
        --prompt-len 4096 --repeats 5     # writes benchmarks/results/kv/p2p_handoff_gpu.json

With both engines on one GPU the p2p connector moves blocks by CUDA IPC (NCCL refuses two
ranks on one GPU); on two GPUs, over NCCL. ``nixl`` (``--connectors p2p,nixl``) READs them
through UCX (CUDA IPC on one GPU); it needs the NIXL wheel (benchmarks/gpu/nixl_wheels.sh).
Only torch and the repository (and for nixl, NIXL) are needed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import CONFIGS, recorded_command, result_path

CONFIG = CONFIGS / "llama-3.1-8b"
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _engine(settings: dict[str, Any], blocks: int, max_len: int) -> Any:
    import os
    import sys

    sys.setswitchinterval(0.001)  # as AsyncLLMEngine sets it in the services

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kv_store.factory import KVStoreSettings, build_connector

    connector = build_connector(KVStoreSettings(**settings))
    config = EngineConfig(
        model=os.environ.get("P2P_BENCH_CONFIG", str(CONFIG)),
        device=os.environ.get("P2P_BENCH_DEVICE", "cuda"),
        dtype="bfloat16" if os.environ.get("P2P_BENCH_DEVICE", "cuda") == "cuda" else "float32",
        load_format="dummy",
        num_kv_blocks=blocks,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        kv_cache_dtype=os.environ.get("P2P_BENCH_KV_DTYPE", "auto"),
    )
    return LLMEngine(config, connector)


def bench_prompt(i: int, length: int) -> list[int]:
    """Prompt ``i`` of a run: deterministic token ids inside the model's vocabulary."""
    import os

    config = Path(os.environ.get("P2P_BENCH_CONFIG", str(CONFIG))) / "config.json"
    vocab = int(json.loads(config.read_text()).get("vocab_size", 32000))
    return [(7919 * (i + 1) * (j + 3)) % (vocab - 10) + 10 for j in range(length)]


def _producer(conn: Any, settings: dict[str, Any], blocks: int, max_len: int) -> None:
    """Prefill each prompt that arrives; answer with its handle; keep stepping so held
    blocks are released when pulled."""
    import os

    os.environ.update(MULTICAST_OFF)
    from engine.core.sampling_params import SamplingParams

    engine = _engine(settings, blocks, max_len)
    conn.send("ready")
    n, first = 0, -1
    while True:
        if conn.poll(0.001):
            prompt = conn.recv()
            if prompt is None:
                break
            n += 1
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            engine.add_request(f"p{n}", prompt, params, save_kv=True)
        for out in engine.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
            if out.kv_saved is not None:
                s = out.kv_saved
                conn.send(
                    {
                        "first": first,
                        "keys": s.block_keys,
                        "num_tokens": s.num_tokens,
                        "transfer_id": s.transfer_id,
                        "address": s.source_address,
                    }
                )
    if engine.connector is not None:
        engine.connector.close()


def _consume(engine: Any, rid: str, prompt: list[int], handle: dict[str, Any], new: int) -> dict:
    from engine.core.request import RemoteKV
    from engine.core.sampling_params import SamplingParams

    remote = RemoteKV(
        handle["keys"], handle["num_tokens"], handle["address"], handle["transfer_id"]
    )
    params = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params, output_token_ids=[handle["first"]], remote_kv=remote)
    stamps: list[float] = []
    tokens = [handle["first"]]
    load_s, recomputed = 0.0, 0
    while engine.has_unfinished():
        steps = engine.num_steps
        outputs = engine.step()
        if engine.num_steps == steps and not outputs:
            # Only the transfer is in flight: give its thread the GIL, as the service's
            # engine loop does (a busy loop here would starve the pull).
            time.sleep(0.001)
        for out in outputs:
            if out.new_token_ids:
                tokens += out.new_token_ids
                stamps.append(time.perf_counter())
                load_s = load_s or out.kv_load_seconds
                recomputed = recomputed or out.kv_blocks_recomputed
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    itl = statistics.median(gaps)
    return {
        "token2_ms": (stamps[0] - t0) * 1e3,
        "itl_ms": itl * 1e3,
        "load_ms": load_s * 1e3,
        "blocks_recomputed": recomputed,  # > 0: the handoff failed and decode recomputed
        "tokens": tokens,
    }


def run(connector: str, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    settings: dict[str, Any] = {"connector": connector, "p2p_host": "127.0.0.1"}
    if connector == "fs":
        settings["kv_path"] = workdir
    blocks = 2 * (args.prompt_len // 16 + 8) + 64
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, settings, blocks, args.prompt_len + 64))
    proc.start()
    try:
        assert parent.poll(600), "producer engine did not start"
        parent.recv()
        consumer = _engine(settings, blocks, args.prompt_len + 64)
        kv = consumer.runner.kv_cache  # [layers, 2, blocks, block, heads, dim]
        consumer_token_bytes = [kv[:, :, 0, 0].numel() * kv.element_size()]
        rows = []
        for i in range(args.repeats + 1):  # the first is a warm-up (graphs, first pair)
            prompt = bench_prompt(i, args.prompt_len)
            parent.send(prompt)
            assert parent.poll(120), "producer did not answer"
            handle = parent.recv()
            row = _consume(consumer, f"c{i}", prompt, handle, args.new_tokens)
            if i:
                rows.append(row)
        parent.send(None)
        if consumer.connector is not None:
            consumer.connector.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    skip = ("blocks_recomputed", "tokens")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in skip}
    kv_bytes = args.prompt_len * consumer_token_bytes[0]
    return {
        "connector": connector,
        **{f"{k}_p50": round(v, 3) for k, v in med.items()},
        "added_ms_p50": round(med["token2_ms"] - med["itl_ms"], 3),
        "kv_mib": kv_bytes / 2**20,
        "fallbacks": sum(1 for r in rows if r["blocks_recomputed"]),
        "load_gb_s": round(kv_bytes / (med["load_ms"] / 1e3) / 1e9, 1) if med["load_ms"] else None,
        "rows": rows,
    }


def main() -> None:
    import os

    os.environ.update(MULTICAST_OFF)
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--connectors", default="p2p,fs")
    p.add_argument("--config", default=str(CONFIG), help="model config directory (dummy weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (both engines)")
    p.add_argument("--json", default=str(result_path("kv", "p2p_handoff_gpu.json")))
    p.add_argument("--md", default=None)
    args = p.parse_args()
    # The spawned producer reads these too.
    os.environ["P2P_BENCH_CONFIG"], os.environ["P2P_BENCH_DEVICE"] = args.config, args.device
    os.environ["P2P_BENCH_KV_DTYPE"] = args.kv_cache_dtype
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.connectors.split(","):
            results.append(run(name, args, workdir))
            # Written after each connector: a later one that hangs past the caller's
            # deadline (one GPU call) still leaves the earlier rows.
            _write(args, results)


def _write(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    head = (
        "| connector | KV MiB | KV load p50 ms | load GB/s | token 2 p50 ms | ITL p50 ms "
        "| added p50 ms | fallbacks |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['connector']} | {r['kv_mib']:.1f} | {r['load_ms_p50']} | {r['load_gb_s']} | "
            f"{r['token2_ms_p50']} | {r['itl_ms_p50']} | {r['added_ms_p50']} | "
            f"{r['fallbacks']}/{len(r['rows'])} |"
        )
    table = "\n".join(lines)
    print(table, flush=True)
    if args.md:
        Path(args.md).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": recorded_command("benchmarks.kv.p2p_handoff_gpu"),
                    "args": vars(args),
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
