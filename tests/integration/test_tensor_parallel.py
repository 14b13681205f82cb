"""Tensor parallelism on the CPU over gloo with real worker processes: N = 2 gives the same
tokens as N = 1 and as transformers (float32), also with fewer KV heads than ranks (KV heads
replicated), a tied, vocab-parallel LM head over a vocabulary that does not split evenly,
chunked prefill, prefix caching, async scheduling and seeded sampling; a worker that dies or
hangs fails the next step with a clear error within its deadline (also through ``LLM``), no
worker outlives its engine, and a size the model or the visible GPUs cannot hold is refused
before any process starts. Guided and speculative decoding and prefix-cache hits under
N = 2: ``test_tensor_parallel_features.py``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.executor.tp.executor import MultiprocExecutor, TensorParallelError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from tests.integration.test_engine_parity import _hf_greedy, _run_staggered
from tests.model_fixtures import make_tiny_llama

MAX_NEW = 8
REPO = Path(__file__).resolve().parents[2]


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    return [
        (prefix if i % 2 else []) + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 50))]
        for i in range(n)
    ]


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _engine(model_dir: Path, tp: int, **overrides: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), tensor_parallel_size=tp, **({"num_kv_blocks": 128} | overrides)
        )
    )


def _workers(engine: LLMEngine) -> list[int]:
    assert isinstance(engine.executor, MultiprocExecutor)
    return engine.executor.worker_pids


@pytest.fixture(scope="module")
def replicated_kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads over 1 KV head (replicated on both ranks), tied embeddings, and a
    vocabulary of 49155 (odd: the second rank's vocab slice is padded)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny_tp_kv1"),
        seed=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        vocab_size=49155,
    )


@pytest.mark.parametrize("model", ["kv_heads_split", "kv_heads_replicated"])
def test_tp2_greedy_matches_tp1_and_transformers(
    model: str, tiny_model_dir: Path, replicated_kv_dir: Path
) -> None:
    model_dir = tiny_model_dir if model == "kv_heads_split" else replicated_kv_dir
    prompts = _prompts(8, seed=5)
    expected = _hf_greedy(model_dir, prompts, MAX_NEW)
    tp1 = _run_staggered(_engine(model_dir, 1), prompts, MAX_NEW)
    engine = _engine(model_dir, 2)
    try:
        assert engine.runner.kv_cache.shape[4] == 1  # this rank's KV heads only
        tp2 = _run_staggered(engine, prompts, MAX_NEW)
        assert engine.kv.pool.prefix_hits > 0, "shared prefixes should hit the prefix cache"
    finally:
        engine.shutdown()
    assert tp1 == expected
    assert tp2 == expected


def test_tp2_chunked_prefill_preemption_async_scheduling_match_tp1(tiny_model_dir: Path) -> None:
    """A small token budget splits prompts over steps (mixed with decodes), a small pool
    forces recompute preemption, and async scheduling sends decode steps' token ids from
    the device (a second broadcast)."""
    prompts = _prompts(6, seed=9)
    knobs = {
        "max_num_batched_tokens": 24,
        "block_size": 8,
        "num_kv_blocks": 16,
        "async_scheduling": True,
    }
    tp1 = _run_staggered(_engine(tiny_model_dir, 1, **knobs), prompts, MAX_NEW)
    engine = _engine(tiny_model_dir, 2, **knobs)
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def counting(request: Any, out: Any) -> int:
        preempted.append(request.request_id)
        return preempt(request, out)

    engine.scheduler._preempt = counting  # type: ignore[method-assign]
    try:
        tp2 = _run_staggered(engine, prompts, MAX_NEW)
        assert preempted, "a 16-block pool must preempt"
        assert engine.pipeline is not None and engine.pipeline.num_launched_ahead > 0
        assert engine.executor.stats.steps == engine.num_steps  # type: ignore[attr-defined]
    finally:
        engine.shutdown()
    assert tp2 == tp1


def _sample(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=100 + i)
        engine.add_request(f"s{i}", p, params)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"s{i}"] for i in range(len(prompts))]


def test_tp2_seeded_sampling_matches_tp1(tiny_model_dir: Path) -> None:
    prompts = _prompts(4, seed=13)
    tp1 = _sample(_engine(tiny_model_dir, 1), prompts)
    engine = _engine(tiny_model_dir, 2)
    try:
        tp2 = _sample(engine, prompts)
    finally:
        engine.shutdown()
    assert tp2 == tp1


@pytest.mark.timeout(120)  # the guard: the default collective deadline is 300 s
def test_killed_worker_fails_the_next_step_clearly(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2)
    pids = _workers(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with signal SIGKILL"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(TensorParallelError):  # and every later step, at once
        engine.step()
    engine.shutdown()
    assert _wait_gone(pids, 5) == []


@pytest.mark.timeout(120)  # the guard: the watch must notice, not the test's patience
def test_a_worker_lost_between_steps_is_reported_by_check(tiny_model_dir: Path) -> None:
    """Rank 0's watch (engine/executor/tp/watch.py) notices a worker that exits while no step runs;
    ``check()``, which ``LLMEngine.step`` calls after every step, then raises naming it and
    stops the rest, and every later step fails the same way."""
    engine = _engine(tiny_model_dir, 2)
    executor = engine.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = _workers(engine)
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        engine.step()
        executor.check()  # healthy: nothing to report
        assert executor.lost is None
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while executor.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.lost == f"rank 1 (pid {pids[0]}) exited with signal SIGKILL"
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with signal"):
            executor.check()
        assert _wait_gone(pids, 5) == []
        with pytest.raises(TensorParallelError):
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)  # the guard: the step must end at its 2 s deadline, not hang
def test_hung_worker_fails_the_step_at_the_deadline(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2, distributed_timeout=2.0)
    pids = _workers(engine)
    try:
        os.kill(pids[0], signal.SIGSTOP)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
        with pytest.raises(TensorParallelError, match="rank 1|no worker exited"):
            engine.step()
    finally:
        engine.shutdown()  # kills the stopped worker
    assert _wait_gone(pids, 5) == []


def test_shutdown_and_a_dead_engine_leave_no_workers(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2)
    pids = _workers(engine)
    engine.shutdown()
    assert _wait_gone(pids, 5) == []
    # Rank 0 killed outright: its worker notices (stdin EOF, parent watchdog) and exits.
    script = (
        "from engine.llm import LLM\n"
        f"llm = LLM({str(tiny_model_dir)!r}, tensor_parallel_size=2, num_kv_blocks=64)\n"
        "print(*llm.engine.executor.worker_pids, flush=True)\n"
        "import time; time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        orphans = [int(p) for p in proc.stdout.readline().split()]
        assert orphans and all(_alive(p) for p in orphans)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(orphans, 10) == []


@pytest.mark.timeout(120)  # the guard: a dead rank must fail generate(), never hang it
def test_llm_api_with_a_rank_killed_mid_generate_raises_and_leaves_no_process(
    tiny_model_dir: Path,
) -> None:
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, num_kv_blocks=128)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = executor.worker_pids
    killed = threading.Event()

    def kill_once_running() -> None:  # mid-generate: after a few steps of a long run
        deadline = time.monotonic() + 60
        while executor.stats.steps < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(pids[0], signal.SIGKILL)
        killed.set()

    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    killer = threading.Thread(target=kill_once_running, daemon=True)
    try:
        killer.start()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with signal"):
            llm.generate([[5, 6, 7], [8, 9]], params)
        assert killed.is_set() and 5 <= executor.stats.steps < 400
        # The failed step already stopped every worker, before any shutdown() call ...
        assert _wait_gone(pids, 5) == []
        with pytest.raises(TensorParallelError):  # ... and the instance stays down
            llm.generate([[5, 6, 7]], params)
    finally:
        llm.shutdown()
        killer.join(5)
    assert _worker_children() == []


def _worker_children() -> list[int]:
    """Live tensor-parallel worker processes whose parent is this process."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"engine.executor.tp.worker" in cmdline and _alive(int(entry)):
            found.append(int(entry))
    return found


def test_more_gpus_than_visible_are_refused_before_any_process_starts(
    tiny_model_dir: Path,
) -> None:
    import torch

    size = 2  # a power of two the visible GPUs cannot hold, on any machine
    while size <= torch.cuda.device_count():
        size *= 2
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size} on cuda needs"):
        LLM(
            str(tiny_model_dir),
            device="cuda",
            tensor_parallel_size=size,
            hf_overrides={"num_attention_heads": max(4, size), "num_key_value_heads": 1},
        )
    assert _worker_children() == []


def test_tensor_parallel_size_that_does_not_fit_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by it"):
        EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads 3"):
        EngineConfig(
            model=str(tiny_model_dir),
            tensor_parallel_size=4,
            hf_overrides={"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16},
        )
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=0)
    # KV connectors run on every rank (test_tp_pd.py); one that cannot (no rank spec:
    # LMCache, or built outside kv_store.factory) is refused before any worker starts.
    from kv_store.block_connector import BlockStoreConnector
    from kv_store.fs_backend import FsBackend

    bare = BlockStoreConnector(FsBackend(str(tmp_path)), name="fs")
    with pytest.raises(ValueError, match="cannot serve tensor_parallel_size > 1"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2), bare)


def test_flag_env_twin_and_up_forwarding(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from service.settings import (
        add_forwarded_engine_arguments,
        add_service_arguments,
        engine_config_from_args,
        forward_engine_flags,
    )

    monkeypatch.setenv("PDSERVE_TENSOR_PARALLEL_SIZE", "2")
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, role="prefill")
    args = parser.parse_args(["--model", str(tiny_model_dir)])
    assert engine_config_from_args(args).tensor_parallel_size == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel-size", "0"])
    up = argparse.ArgumentParser()
    add_forwarded_engine_arguments(up)
    assert forward_engine_flags(up.parse_args(["--tensor-parallel-size", "4"])) == [
        "--tensor-parallel-size",
        "4",
    ]
