"""`pdserve up` with prefill and decode pools split differently (issue 38):
``--prefill-tensor-parallel-size`` / ``--decode-tensor-parallel-size`` and the pipeline
twins give each pool its own sizes (one size flag per engine, GPUs in groups of its own
P x N); a pool the model cannot be split for fails before anything starts, naming it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.pool_parallel import assign_gpu_groups, check_pool_sizes, pool_sizes
from pdserve.procs import LaunchError
from tests.unit.test_launcher_gpus import flag, gpu_env, plan


def test_each_pool_gets_its_own_sizes_and_gpu_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--device", "cuda", "--gpus", "4", "--prefill-tensor-parallel-size", "2"]
    argv += ["--decode-pipeline-parallel-size", "2", "--tensor-parallel-size", "1"]
    children = plan(tmp_path, argv, monkeypatch)
    prefill, decode = children["prefill-0"], children["decode-0"]
    assert flag(prefill, "--tensor-parallel-size") == "2"
    assert flag(prefill, "--pipeline-parallel-size") is None
    assert flag(decode, "--tensor-parallel-size") == "1"  # the shared size, once
    assert flag(decode, "--pipeline-parallel-size") == "2"
    assert gpu_env(prefill) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_env(decode) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_a_pool_without_its_own_size_takes_the_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"]
    children = plan(tmp_path, [*argv, "--decode", "2"], monkeypatch)
    assert flag(children["prefill-0"], "--tensor-parallel-size") == "2"
    assert [flag(children[f"decode-{i}"], "--tensor-parallel-size") for i in (0, 1)] == ["1"] * 2
    args = argparse.Namespace(tensor_parallel_size=2, decode_tensor_parallel_size=1)
    assert (pool_sizes(args, "prefill"), pool_sizes(args, "decode")) == ((1, 2), (1, 1))


def test_gpu_groups_follow_each_engines_size() -> None:
    assert assign_gpu_groups([2, 1, 1], ["0", "1", "2", "3"]) == ["0,1", "2", "3"]
    assert assign_gpu_groups([2, 2, 2], ["0", "1", "2", "3", "4"]) == ["0,1", "2,3", "0,1"]
    assert assign_gpu_groups([4, 1], None) == [None, None]
    with pytest.raises(LaunchError, match="needs 4 GPUs; --gpus / --gpu-ids give 2"):
        assign_gpu_groups([1, 4], ["0", "1"])


def test_a_pool_the_model_cannot_split_is_named(tiny_model_dir: Path) -> None:
    ok = argparse.Namespace(prefill_tensor_parallel_size=2, decode_pipeline_parallel_size=2)
    check_pool_sizes(str(tiny_model_dir), ok)  # 4 heads / 2 KV heads, 2 layers
    bad = argparse.Namespace(decode_tensor_parallel_size=3)
    with pytest.raises(LaunchError, match="decode pool: --tensor-parallel-size 3"):
        check_pool_sizes(str(tiny_model_dir), bad)
