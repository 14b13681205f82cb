"""The nixl connector between two processes on one GPU (VRAM pools; UCX moves the READ by
CUDA IPC): blocks arrive bit for bit, an abort mid-pull keeps the data whole and frees the
hold, and a prefill → decode handoff between two engines gives the tokens a colocated
engine computes. Needs NIXL (carried by benchmarks/gpu/nixl_wheels.sh); skipped, saying so,
without a GPU or without NIXL.

    PYTHONPATH=.:$NIXL_DIR python3 -m pytest -q -m gpu tests/gpu/test_nixl_gpu.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kv_store.nixl.agent import nixl_available
from tests.gpu.test_p2p_gpu import DST, GPU_LAYOUT, SRC
from tests.integration.p2p_support import Worker, wait_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU present"),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (nixl_wheels.sh)"),
]
COMMON = {"layout": GPU_LAYOUT, "num_blocks": 48, "connector": "nixl", "device": "cuda:0"}


def test_two_processes_one_gpu_bit_exact(tmp_path: Path) -> None:
    prefill = Worker(tmp_path, "prefill", seed=1, **COMMON)
    decode = Worker(tmp_path, "decode", seed=2, **COMMON)
    try:
        offer = prefill.offer("g1", SRC)
        got = decode.call("pull", timeout=120, **decode.pull_args(prefill, offer, "g1", SRC, DST))
        assert got["ok"] and got["loaded"] == len(SRC) and got["equal"], got
        assert got["bytes"] == len(SRC) * 2 * 1024 * 1024
        stats = prefill.call("wait_released", count=1, timeout=30)
        assert stats["releases"] == [{"request_id": "g1", "ok": True, "reason": None}]
        assert stats["p2p"]["blocks_held"] == 0
    finally:
        prefill.stop()
        decode.stop()


def test_abort_mid_pull_on_the_gpu(tmp_path: Path) -> None:
    marker = tmp_path / "pinned"
    prefill = Worker(tmp_path, "prefill", seed=1, slow_s=1.0, marker=str(marker), **COMMON)
    decode = Worker(tmp_path, "decode", seed=2, **COMMON)
    try:
        offer = prefill.offer("a", SRC)
        decode.send("pull", **decode.pull_args(prefill, offer, "a", SRC, DST))
        wait_for(marker, 60)
        assert prefill.call("abort", request_id="a")["found"]
        got = decode.reply(60)
        assert got["ok"] and got["equal"], got
        stats = prefill.call("wait_released", count=1, timeout=30)
        assert stats["releases"] == [{"request_id": "a", "ok": False, "reason": "aborted"}]
        assert stats["p2p"]["blocks_held"] == 0
    finally:
        prefill.stop()
        decode.stop()


def test_engine_handoff_tokens_equal_colocated() -> None:
    """Two engines (tiny Llama, dummy weights from one seed) on the GPU: the decode engine's
    greedy tokens after a nixl handoff equal a colocated engine's for the same prompts."""
    import os

    from benchmarks.kv.p2p_handoff_gpu import bench_prompt, run
    from benchmarks.record import CONFIGS
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    config = str(CONFIGS / "tiny-llama")
    os.environ["P2P_BENCH_CONFIG"], os.environ["P2P_BENCH_DEVICE"] = config, "cuda"
    os.environ["P2P_BENCH_KV_DTYPE"] = "auto"
    args = argparse.Namespace(prompt_len=200, new_tokens=8, repeats=2)
    result = run("nixl", args, "/tmp")
    assert result["fallbacks"] == 0, result  # the KV came by READ, not by recompute

    engine = LLMEngine(
        EngineConfig(model=config, device="cuda", dtype="bfloat16", load_format="dummy",
                     num_kv_blocks=64, max_model_len=264)
    )  # fmt: skip
    for i, row in enumerate(result["rows"], start=1):  # the prompts run() made (warm-up: 0)
        prompt = bench_prompt(i, args.prompt_len)
        params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
        engine.add_request(f"c{i}", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert row["tokens"][: len(tokens)] == tokens, (row["tokens"], tokens)


@pytest.mark.parametrize(("src", "dst", "kv_heads"), [((1, 1), (1, 2), 4), ((2, 2), (1, 1), 4)])
def test_recut_between_unlike_grids_on_the_gpu(
    src: tuple[int, int], dst: tuple[int, int], kv_heads: int
) -> None:
    """VRAM pools of two grids, the prefill grid in a process of its own: each decode
    process READs its cells from the other process (heads through a registered VRAM
    scratch, layers straight into the pool) and every lease ends as pulled."""
    import multiprocessing as mp

    from tests.integration.test_nixl_recut import Prefill, read_cells, serve_prefill

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_prefill, args=(child, src, kv_heads, "cuda"))
    proc.start()
    connectors: list = []
    try:
        assert parent.poll(120), "the prefill grid did not start"
        handle, fingerprint = parent.recv()
        read_cells(connectors, Prefill([], handle, fingerprint), src, dst, kv_heads, "cuda")
        parent.send("done")
        assert parent.poll(30) and parent.recv(), "a prefill lease did not end as pulled"
    finally:
        for c in connectors:
            c.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
