"""Tensor parallelism on two GPUs (NCCL): N = 2 greedy output equals N = 1 in float32 on a
random Llama (KV heads split, and replicated), bfloat16 runs with the Triton backend and
fused kernels, and a killed worker fails the next step clearly. CUDA graphs under N = 2:
every rank captures its decode graphs with the collectives inside, replays give the tokens
of eager N = 1, and a worker killed or stopped while graphs replay fails the engine with
``TensorParallelError`` (rank 0's step watch aborts the communicator) instead of hanging.

Not yet run on GPUs (no two-GPU machine was available when it was written). Runs under
pytest (``-m gpu``) or as a script:

    PYTHONPATH=. python3 tests/gpu/test_tp_gpu.py
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.tp.executor import TensorParallelError
from engine.llm import LLM

pytestmark = pytest.mark.gpu


def _model(out: Path, kv_heads: int) -> Path:
    """A random float32 Llama (4 layers, hidden 256, 8 query heads) without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(kv_heads)
    cfg = LlamaConfig(
        vocab_size=4099,  # odd: the vocab slices are padded
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
    )
    LlamaForCausalLM(cfg).float().save_pretrained(str(out))
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 4000) for _ in range(rng.randrange(5, 200))] for _ in range(12)]


def _generate(model: Path, tp: int, dtype: str, **kwargs: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(model), device="cuda", dtype=dtype, tensor_parallel_size=tp, **kwargs) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), params)]


def _need_two() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs, {torch.cuda.device_count()} present")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp2_matches_tp1_float32(kv_heads: int, tmp_path: Path) -> None:
    _need_two()
    model = _model(tmp_path / f"kv{kv_heads}", kv_heads)
    assert _generate(model, 2, "float32") == _generate(model, 1, "float32")


def test_tp2_bfloat16_mostly_matches(tmp_path: Path) -> None:
    """bf16 sums in another order can flip a near-tie; most sequences still agree."""
    _need_two()
    model = _model(tmp_path / "bf16", 2)
    one, two = _generate(model, 1, "bfloat16"), _generate(model, 2, "bfloat16")
    same = sum(a == b for a, b in zip(one, two, strict=True))
    assert same >= len(one) * 2 // 3, f"only {same} of {len(one)} sequences agree"


def test_killed_worker_fails_clearly(tmp_path: Path) -> None:
    _need_two()
    model = _model(tmp_path / "kill", 2)
    llm = LLM(str(model), device="cuda", tensor_parallel_size=2, distributed_timeout=20.0)
    try:
        os.kill(llm.engine.executor.worker_pids[0], signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(TensorParallelError, match="SIGKILL"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def test_tp2_cuda_graphs_replay_the_collectives(tmp_path: Path) -> None:
    """Graphs on both ranks (all-reduces and the logits' all-gather captured) give the
    tokens of eager N = 1; rank 0's decode steps really were replays."""
    _need_two()
    model = _model(tmp_path / "graphs", 2)
    eager = _generate(model, 1, "float32", cuda_graphs=False, attention_backend="triton")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(
        str(model), device="cuda", dtype="float32", tensor_parallel_size=2,
        attention_backend="triton", max_num_seqs=16,
    ) as llm:  # fmt: skip
        graphs = llm.engine.runner.graphs
        assert graphs is not None, "decode graphs must be captured under tensor parallelism"
        got = [o.token_ids for o in llm.generate(_prompts(), params)]
        assert graphs.num_replays > 0
    assert got == eager


def _lose_a_worker_mid_decode(tmp_path: Path, sig: signal.Signals, timeout_s: float) -> None:
    """Long greedy decodes (graph replays) on N = 2; ``sig`` to the worker after a few
    steps; generate must raise ``TensorParallelError`` (the test's timeout is the guard)."""
    model = _model(tmp_path / "lose", 2)
    llm = LLM(
        str(model), device="cuda", dtype="float32", tensor_parallel_size=2,
        attention_backend="triton", distributed_timeout=timeout_s,
    )  # fmt: skip
    executor: Any = llm.engine.executor
    pid = executor.worker_pids[0]

    def hit() -> None:
        deadline = time.monotonic() + 120
        while executor.stats.steps < 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, sig)

    killer = threading.Thread(target=hit, daemon=True)
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    try:
        assert llm.engine.runner.graphs is not None
        killer.start()
        expected = "SIGKILL" if sig == signal.SIGKILL else "no worker exited|did not finish"
        with pytest.raises(TensorParallelError, match=expected):
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
        assert llm.engine.runner.graphs.num_replays > 0
    finally:
        llm.shutdown()  # kills a stopped worker
        killer.join(5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.timeout(300)
def test_killed_worker_while_graphs_replay_fails_clearly(tmp_path: Path) -> None:
    _need_two()
    _lose_a_worker_mid_decode(tmp_path, signal.SIGKILL, timeout_s=60.0)


@pytest.mark.timeout(300)
def test_stopped_worker_while_graphs_replay_fails_at_the_deadline(tmp_path: Path) -> None:
    _need_two()
    _lose_a_worker_mid_decode(tmp_path, signal.SIGSTOP, timeout_s=10.0)


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "--noconftest", "-p", "no:cacheprovider", __file__]))
