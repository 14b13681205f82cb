"""KV handoff between tensor-parallel instances vs N = 1 (docs/design.md §3, "KV with
tensor parallelism"): a prefill engine saves (fs) or offers (p2p) a prompt's KV, a decode
engine loads (pulls) it; both engines in this process, their worker ranks real processes.

    python -m benchmarks.kv.tp_pd_handoff     # writes benchmarks/results/kv/tp_pd_handoff.json

Reports per connector and N (after one warm-up prompt) the median save time (the prefill's ``KvSaveResult.seconds``),
load time (the decode's ``kv_load_seconds``: start of the load to every rank done) over
``--repeats`` prompts of ``--prompt-tokens``; the
decode's greedy tokens are checked equal to N = 1's. On a shared CPU machine compare the
ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from engine.config import EngineConfig
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_store.factory import KVStoreSettings, build_connector

logger = logging.getLogger("tp_pd_handoff")
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}


def _settings(kind: str, kv_dir: str) -> KVStoreSettings:
    if kind == "fs":
        return KVStoreSettings(connector="fs", kv_path=kv_dir)
    return KVStoreSettings(connector="p2p", p2p_timeout_s=60)


def _run_until(engine: LLMEngine, stop: Any) -> list[Any]:
    outs: list[Any] = []
    deadline = time.monotonic() + 300
    while engine.has_unfinished() and time.monotonic() < deadline:
        outs += engine.step()
        if stop(outs):
            break
    return outs


def measure(model: Path, kind: str, tp: int, prompts: list[list[int]]) -> dict[str, Any]:
    kv_dir = tempfile.mkdtemp(prefix="tp-pd-kv-")
    config = EngineConfig(model=str(model), num_kv_blocks=512, tensor_parallel_size=tp)
    prefill = LLMEngine(config, build_connector(_settings(kind, kv_dir)))
    dec = LLMEngine(config, build_connector(_settings(kind, kv_dir)))
    saves, loads, tokens = [], [], []
    stop = threading.Event()

    def step_prefill() -> None:  # p2p: the prefill serves pulls and frees on release
        while not stop.is_set():
            if prefill.has_unfinished():
                prefill.step()
            time.sleep(0.002)

    try:
        for i, prompt in enumerate(prompts):
            prefill.add_request(
                f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), save_kv=True
            )
            outs = _run_until(prefill, lambda o: any(x.kv_saved is not None for x in o))
            first = next(x.new_token_ids[0] for x in outs if x.new_token_ids)
            saved = next(x.kv_saved for x in outs if x.kv_saved is not None)
            assert saved is not None and saved.error is None, saved
            if i:
                saves.append(saved.seconds)
            server = threading.Thread(target=step_prefill, daemon=True)
            stop.clear()
            server.start()
            remote = RemoteKV(
                saved.block_keys, len(prompt), saved.source_address, saved.transfer_id
            )
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            dec.add_request(f"d{i}", prompt, params, output_token_ids=[first], remote_kv=remote)
            outs = _run_until(dec, lambda o: False)
            stop.set()
            server.join()
            if i == 0:
                continue  # warm-up: first files, the p2p pair's group, the workers' threads
            loads.append(max(x.kv_load_seconds for x in outs))
            tokens.append([first] + [t for x in outs for t in x.new_token_ids])
        assert dec.transfers is not None
        stats = dec.transfers.stats
        assert stats.blocks_recomputed == 0, f"{kind} N={tp}: {stats}"
    finally:
        for engine in (prefill, dec):
            if engine.connector is not None:
                engine.connector.close()
            engine.shutdown()
    return {
        "connector": kind,
        "tensor_parallel_size": tp,
        "save_s_median": statistics.median(saves),
        "load_s_median": statistics.median(loads),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=str(result_path("kv", "tp_pd_handoff.json")))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from tests.model_fixtures import make_tiny_llama

    model = make_tiny_llama(tempfile.mkdtemp(prefix="tp-pd-model-"), **SHAPE)
    prompts = [
        [1000 + (i * 7919 + j * 31) % 40000 for j in range(args.prompt_tokens)]
        for i in range(args.repeats + 1)  # the first is a warm-up, not counted
    ]
    kv_bytes_per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 32 * 4
    rows = [measure(model, kind, tp, prompts) for kind in ("fs", "p2p") for tp in (1, 2)]
    for kind in ("fs", "p2p"):
        one, two = (r for r in rows if r["connector"] == kind)
        assert one["tokens"] == two["tokens"], f"{kind}: N = 2 tokens differ from N = 1"
    result = {
        "command": recorded_command("benchmarks.kv.tp_pd_handoff"),
        "model": SHAPE | {"dtype": "float32", "kv_bytes_per_token": kv_bytes_per_token},
        "prompt_kv_mib": kv_bytes_per_token * args.prompt_tokens / 2**20,
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| connector | N | save median (ms) | load median (ms) | load vs N = 1 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            x for x in rows if x["connector"] == r["connector"] and x["tensor_parallel_size"] == 1
        )
        lines.append(
            f"| {r['connector']} | {r['tensor_parallel_size']} | {1e3 * r['save_s_median']:.1f} "
            f"| {1e3 * r['load_s_median']:.1f} | {r['load_s_median'] / base['load_s_median']:.2f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
