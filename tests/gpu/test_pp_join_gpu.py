"""A pipeline group whose stage 1 joined by address (``engine/executor/pp/join.py``), on two
GPUs of one host: the leader (an ``LLM`` with ``pipeline_leader``) on cuda:0, stage 1 a
process started on its own on cuda:1, so the grid's NCCL group forms through the leader's
store reached by address, as between the pods of two nodes. Greedy float32 tokens equal a
P = 1 engine's. The multi-node run itself (two 8-GPU nodes, the Helm chart's pipeline
group) needs such nodes; docs/kubernetes.md "Pipeline parallelism".

Not yet run on GPUs. Runs under pytest (``-m gpu``) or as a script:

    PYTHONPATH=. python3 tests/gpu/test_pp_join_gpu.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from pdserve.procs import free_ports
from tests.gpu.test_tp_gpu import _model, _prompts

pytestmark = pytest.mark.gpu

_JOIN = """
import sys
from engine.config import EngineConfig
from engine.executor.pp.join import join_stage
config = EngineConfig(model=sys.argv[1], device="cuda:1", dtype="float32",
                      pipeline_parallel_size=2, pipeline_stage=1, pipeline_leader=sys.argv[2])
sys.exit(join_stage(config))
"""


def test_joined_stage_on_the_second_gpu_matches_p1(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs, {torch.cuda.device_count()} present")
    model = _model(tmp_path / "model", 2)
    leader = f"127.0.0.1:{free_ports(1)[0]}"
    stage = subprocess.Popen([sys.executable, "-c", _JOIN, str(model), leader])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        with LLM(
            str(model), device="cuda:0", dtype="float32",
            pipeline_parallel_size=2, pipeline_leader=leader,
        ) as llm:  # fmt: skip
            joined = [o.token_ids for o in llm.generate(_prompts(), params)]
        assert stage.wait(timeout=60) == 0  # the leader ended the group
    finally:
        if stage.poll() is None:
            stage.kill()
    with LLM(str(model), device="cuda:0", dtype="float32") as llm:
        alone = [o.token_ids for o in llm.generate(_prompts(), params)]
    assert joined == alone


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        test_joined_stage_on_the_second_gpu_matches_p1(Path(tmp))
    print("ok")
