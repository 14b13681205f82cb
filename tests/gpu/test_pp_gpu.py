"""Pipeline parallelism on GPUs (NCCL sends between stages): P = 2 on two GPUs, and
P = 2 × N = 2 on four, give the greedy tokens of P = 1 in float32 with batches in flight
and without; a killed stage fails the engine with ``PipelineParallelError`` instead of
hanging. Skipped with fewer GPUs than a test needs.

Not yet run on GPUs (written on a CPU-only machine; the same code runs over gloo in
``tests/integration/test_pipeline_parallel.py``). Runs under pytest (``-m gpu``) or as a
script:

    PYTHONPATH=. python3 tests/gpu/test_pp_gpu.py
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.pp.executor import PipelineParallelError
from engine.llm import LLM

pytestmark = pytest.mark.gpu


def _need(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {torch.cuda.device_count()} present")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random float32 Llama (4 layers: 2 per stage, 8 query heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4099,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
    )
    out = tmp_path_factory.mktemp("pp_gpu")
    LlamaForCausalLM(cfg).float().save_pretrained(str(out))
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 4000) for _ in range(rng.randrange(5, 200))] for _ in range(12)]


def _generate(model: Path, **kwargs: Any) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(model), device="cuda", dtype="float32", **kwargs) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), params)]


@pytest.mark.parametrize("inflight", [True, False])
def test_pp2_matches_pp1_float32(model: Path, inflight: bool) -> None:
    _need(2)
    two = _generate(model, pipeline_parallel_size=2, pipeline_inflight_batches=inflight)
    assert two == _generate(model)


def test_pp2_tp2_matches_pp1_float32(model: Path) -> None:
    _need(4)
    grid = _generate(model, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert grid == _generate(model)


@pytest.mark.timeout(300)
def test_killed_stage_fails_clearly(model: Path) -> None:
    _need(2)
    llm = LLM(str(model), device="cuda", pipeline_parallel_size=2, distributed_timeout=20.0)
    try:
        os.kill(llm.engine.executor.worker_pids[0], signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(PipelineParallelError, match="SIGKILL"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "--noconftest", "-p", "no:cacheprovider", __file__]))
