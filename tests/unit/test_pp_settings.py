"""`--pipeline-parallel-size` / vLLM's `-pp`: the flag reaches ``EngineConfig``; `pdserve
up` gives each engine P × N GPUs of its own and forwards the flag; a P the model's layers
cannot split fails before anything starts; which checkpoint tensors a stage loads
(``engine/models/stages.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.args import EngineArgs
from engine.models.stages import Stage, check_pipeline_parallel
from pdserve.gpus import assign_gpus
from pdserve.procs import LaunchError, free_ports
from tests.unit.test_launcher_gpus import flag, gpu_env, plan

REPO = Path(__file__).resolve().parents[2]


def test_short_flag_reaches_the_engine_config(tiny_model_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_arguments(parser)
    ns = parser.parse_args(["--model", str(tiny_model_dir), "-pp", "2"])
    config = EngineArgs.from_args(ns).create_engine_config()
    assert config.pipeline_parallel_size == 2 and config.pipeline_inflight_batches
    ns = parser.parse_args(["--model", str(tiny_model_dir), "--no-pipeline-inflight-batches"])
    assert not EngineArgs.from_args(ns).create_engine_config().pipeline_inflight_batches


def test_each_engine_gets_p_times_n_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--device", "cuda", "--gpus", "8", "-pp", "2", "--tensor-parallel-size", "2"]
    children = plan(tmp_path, argv, monkeypatch)
    assert gpu_env(children["prefill-0"]) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert gpu_env(children["decode-0"]) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    for name in ("prefill-0", "decode-0"):
        assert flag(children[name], "--pipeline-parallel-size") == "2"
    with pytest.raises(LaunchError, match="= 4 needs 4 GPUs per engine"):
        assign_gpus(2, ["0", "1", "2"], 4)


def test_pdserve_up_refuses_a_size_the_layers_cannot_split(tiny_model_dir: Path) -> None:
    port = str(free_ports(1)[0])
    argv = ["up", "--model", str(tiny_model_dir), "--port", port, "-pp", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "--pipeline-parallel-size 3" in done.stderr and "exceeds" in done.stderr


def test_stage_layers_and_checkpoint_names() -> None:
    check_pipeline_parallel(30, 5)
    with pytest.raises(ValueError, match=r"does not divide.*\[1, 2, 3, 5, 6, 10, 15, 30\]"):
        check_pipeline_parallel(30, 4)
    first, last = Stage(0, 2, 4), Stage(1, 2, 4)
    assert list(first.layers) == [0, 1] and list(last.layers) == [2, 3]
    assert (
        first.local_name("layers.1.mlp.down_proj.weight", False) == "layers.1.mlp.down_proj.weight"
    )
    assert first.local_name("layers.2.mlp.down_proj.weight", False) is None
    assert (
        last.local_name("layers.3.self_attn.o_proj.weight", False)
        == "layers.1.self_attn.o_proj.weight"
    )
    assert first.local_name("embed_tokens.weight", True) == "embed_tokens.weight"
    assert first.local_name("norm.weight", False) is None
    assert last.local_name("norm.weight", False) == "norm.weight"
    assert last.local_name("embed_tokens.weight", False) is None
    assert last.local_name("embed_tokens.weight", True) == "lm_head.weight"  # tied head
    assert Stage.whole(4).local_name("layers.3.x", False) == "layers.3.x"


def test_chart_engine_pod_requests_p_times_n_gpus() -> None:
    from tests.unit.helm_support import RELEASE, container, find, render

    sets = ("engine.pipelineParallelSize=2", "engine.tensorParallelSize=2", "engine.device=cuda")
    # Every stage in one pod (not a pipeline group of one pod per stage: test_helm_chart_pp).
    objs = render(sets=(*sets, "engine.pipelinePodPerStage=false"))
    assert (
        find(objs, "ConfigMap", f"{RELEASE}-pdserve")["data"]["PDSERVE_PIPELINE_PARALLEL_SIZE"]
        == "2"
    )
    for role in ("prefill", "decode"):
        pod = find(objs, "Deployment", f"{RELEASE}-pdserve-{role}")
        c = container(pod, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
