"""Bad input gets a ValueError naming the field (and its allowed range) — never a crash
deep inside torch, and never a half-added request."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 22)
    )


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1"),
        ({"max_tokens": -3}, r"max_tokens must be an integer >= 1"),
        ({"max_tokens": 2.5}, r"max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": float("nan")}, r"temperature must be >= 0 and finite"),
        ({"temperature": float("inf")}, r"temperature must be >= 0 and finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_p": -0.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be -1 \(off\) or >= 1"),
        ({"top_k": -2}, r"top_k must be -1 \(off\) or >= 1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
        ({"repetition_penalty": float("nan")}, r"repetition_penalty must be > 0 and finite"),
        ({"repetition_penalty": float("inf")}, r"repetition_penalty must be > 0 and finite"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\)"),
        ({"stop": [""]}, r"stop must be a list of non-empty strings"),
    ],
)
def test_sampling_params_reject(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_sampling_params_accept_edges() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(top_k=1, top_p=1e-6, logprobs=0, seed=0)
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"dtype": "float64"}, r"dtype must be one of"),
        ({"device": "tpu"}, r"device must be 'cpu' or 'cuda\[:N\]'"),
        ({"block_size": 12}, r"block_size must be a power of two"),
        ({"block_size": 0}, r"block_size must be a power of two"),
        ({"max_num_seqs": 0}, r"max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be >= 1"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"num_kv_blocks": 1}, r"num_kv_blocks must be >= 2"),
        ({"kv_cache_memory": 0}, r"kv_cache_memory must be > 0"),
        ({"scheduling_policy": "lifo"}, r"scheduling_policy must be one of"),
        ({"load_format": "pt"}, r"load_format must be one of \('auto', 'dummy'\)"),
        ({"max_model_len": 0}, r"max_model_len must be >= 1"),
        ({"kv_load_failure": "ignore"}, r"kv_load_failure must be"),
    ],
)
def test_engine_config_reject(
    tiny_model_dir: Path, overrides: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(model=str(tiny_model_dir), **overrides)


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model: .* is not a directory"):
        EngineConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"model: no \*\.safetensors"):
        EngineConfig(model=str(tmp_path))


def test_unknown_model_name_through_llm() -> None:
    from engine import LLM

    with pytest.raises(ValueError, match=r"unknown model 'no-such-model-xyz'"):
        LLM("no-such-model-xyz")


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.llm_engine import LLMEngine

    model = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported; supported: "
    ):
        LLMEngine(EngineConfig(model=str(model)))
    cfg.pop("architectures")
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"architecture '\(none\)' is not supported"):
        LLMEngine(EngineConfig(model=str(model)))


def test_max_model_len_above_model_limit(tiny_model_dir: Path) -> None:
    from engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"max_model_len 100000 exceeds the model's limit 2048"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_dir), max_model_len=100_000, kv_cache_memory=1 << 20)
        )


@pytest.mark.parametrize(
    ("prompt", "params", "pattern"),
    [
        ([], SamplingParams(), r"prompt must contain at least one token"),
        (
            list(range(100, 164)),
            SamplingParams(),
            r"prompt has 64 tokens; the maximum is 63 \(max_model_len 64\)",
        ),
        (list(range(100, 300)), SamplingParams(), r"prompt has 200 tokens; the maximum is 63"),
        ([5, 49152], SamplingParams(), r"token ids must be in \[0, 49152\)"),
        ([5, -1], SamplingParams(), r"token ids must be in \[0, 49152\)"),
        (
            [5, 6],
            SamplingParams(stop_token_ids=[2, 49152]),
            r"stop_token_ids must be in \[0, 49152\), got \[49152\]",
        ),
        (
            [5, 6],
            SamplingParams(logit_bias={3: 1.0, 49152: 2.0}),
            r"logit_bias keys must be in \[0, 49152\), got \[49152\]",
        ),
    ],
)
def test_add_request_rejects(
    engine: Any, prompt: list[int], params: SamplingParams, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.scheduler.requests
    assert not engine.has_unfinished()


def test_add_request_boundary_and_duplicate_id(engine: Any) -> None:
    engine.add_request("edge", list(range(100, 163)), SamplingParams(max_tokens=5, temperature=0.0))
    with pytest.raises(ValueError, match=r"request_id 'edge' is already in use"):
        engine.add_request("edge", [1, 2], SamplingParams())
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    # 63 prompt tokens + 1 generated reaches max_model_len 64: finished by length.
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 1


def test_already_generated_must_leave_room(engine: Any) -> None:
    with pytest.raises(ValueError, match=r"2 tokens already generated but max_tokens is 2"):
        engine.add_request("gen", [5, 6], SamplingParams(max_tokens=2), output_token_ids=[7, 8])


def test_remote_kv_without_connector(engine: Any) -> None:
    with pytest.raises(ValueError, match=r"no KV connector"):
        engine.add_request("skv", [5, 6], SamplingParams(), save_kv=True)


def test_request_larger_than_the_pool(tiny_model_dir: Path) -> None:
    from engine.llm_engine import LLMEngine

    small = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=3, max_model_len=256))
    with pytest.raises(ValueError, match=r"request needs 4 KV blocks but the pool has 2"):
        small.add_request("big", list(range(100, 140)), SamplingParams(max_tokens=20))


def test_llm_generate_text_and_params_count(tiny_model_dir: Path) -> None:
    from engine import LLM

    llm = LLM(str(tiny_model_dir), kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match=r"got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match=r"prompt must contain at least one token"):
        llm.generate([[]], SamplingParams())


def test_model_combinations_are_refused_at_start(tmp_path: Path) -> None:
    """An FP8 checkpoint of an architecture with fused or per-expert tensors, and a
    head_dim the Triton kernels cannot tile on CUDA, are start-up errors naming the
    combination; Phi-3-mini's 96 is served (tiles padded to 128)."""
    from engine.models.config import ModelArgs
    from engine.models.support import check_combination

    base = {
        "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 128,
    }  # fmt: skip
    moe = ModelArgs.from_hf(
        base
        | {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        }
    )
    with pytest.raises(
        ValueError, match="FP8 checkpoints are not supported for MixtralForCausalLM"
    ):
        check_combination(moe, fp8_checkpoint=True, device="cpu")
    check_combination(moe, fp8_checkpoint=False, device="cuda")
    phi3 = ModelArgs.from_hf(base | {"architectures": ["Phi3ForCausalLM"], "head_dim": 96})
    check_combination(phi3, fp8_checkpoint=False, device="cuda")
    odd = ModelArgs.from_hf(base | {"architectures": ["Phi3ForCausalLM"], "head_dim": 100})
    with pytest.raises(ValueError, match="Phi3ForCausalLM with head_dim 100 on CUDA"):
        check_combination(odd, fp8_checkpoint=False, device="cuda")
    check_combination(odd, fp8_checkpoint=False, device="cpu")
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*text models"):
        ModelArgs.from_hf(base | {"architectures": ["Gemma3ForConditionalGeneration"]})
