"""`pdserve up --tensor-parallel-size N`: each engine gets N GPUs of its own (a
``CUDA_VISIBLE_DEVICES`` range) and the flag; too few GPUs, or a model whose heads N does
not divide, fail before anything starts with a message that says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.gpus import assign_gpus, check_tensor_parallel_size
from pdserve.procs import LaunchError, free_ports
from tests.unit.test_launcher_gpus import flag, gpu_env, plan

REPO = Path(__file__).resolve().parents[2]


def test_each_engine_gets_its_own_n_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--device", "cuda", "--gpus", "4", "--tensor-parallel-size", "2"]
    children = plan(tmp_path, argv, monkeypatch)
    assert gpu_env(children["prefill-0"]) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_env(children["decode-0"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    for name in ("prefill-0", "decode-0"):
        assert flag(children[name], "--tensor-parallel-size") == "2"
        assert flag(children[name], "--gpu-memory-utilization") is None  # alone on them
    assert flag(children["router"], "--tensor-parallel-size") is None


def test_engines_sharing_a_gpu_group_split_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--device", "cuda", "--gpu-ids", "4,5", "--tensor-parallel-size", "2"]
    children = plan(tmp_path, [*argv, "--decode", "2"], monkeypatch)
    groups = [gpu_env(children[n])["CUDA_VISIBLE_DEVICES"] for n in ("prefill-0", "decode-0")]
    assert groups == ["4,5", "4,5"]
    assert flag(children["decode-1"], "--gpu-memory-utilization") == "0.300"


def test_groups_round_robin_and_too_few_gpus_refused() -> None:
    assert assign_gpus(3, ["0", "1", "2", "3", "4"], 2) == ["0,1", "2,3", "0,1"]
    assert assign_gpus(2, None, 4) == [None, None]  # unpinned: the engines check the count
    with pytest.raises(LaunchError, match="needs 4 GPUs per engine; --gpus / --gpu-ids give 2"):
        assign_gpus(2, ["0", "1"], 4)


def test_head_count_not_divisible_is_refused(tiny_model_dir: Path) -> None:
    check_tensor_parallel_size(str(tiny_model_dir), 1)
    check_tensor_parallel_size(str(tiny_model_dir), 2)  # 4 heads, 2 KV heads
    check_tensor_parallel_size(str(tiny_model_dir), 4)  # KV heads replicated
    with pytest.raises(LaunchError, match="num_attention_heads 4 is not divisible"):
        check_tensor_parallel_size(str(tiny_model_dir), 3)


def test_pdserve_up_refuses_before_starting_anything(tiny_model_dir: Path) -> None:
    """The real CLI: exit 1 with the reason, no child started (it would log its port)."""
    port = str(free_ports(1)[0])
    argv = ["up", "--model", str(tiny_model_dir), "--port", port, "--tensor-parallel-size", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "--tensor-parallel-size 3" in done.stderr and "num_attention_heads 4" in done.stderr
    assert "starting" not in done.stdout
