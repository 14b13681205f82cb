"""FP8 for the new architectures on the CPU: ``quantization="fp8"`` quantizes an MoE
block's experts per (expert, output channel) and its output stays within e4m3's rounding
of the unquantized block; an engine of each new family loads with FP8 projections (and
FP8 experts) and its first greedy token's logprob is within FP8 noise of the float one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.distributed.tp_group import TPGroup
from engine.models.config import ModelArgs
from engine.models.layer_ops import TorchOps
from engine.models.moe import MoEBlock
from engine.models.parallel import Shard

FP8_ARCHS = ("phi3", "gemma2", "mixtral", "qwen3_moe", "gpt_oss")


def test_quantized_experts_stay_close() -> None:
    args = ModelArgs.from_hf(
        {
            "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        }
    )  # fmt: skip
    torch.manual_seed(0)
    block = MoEBlock(Shard(args), TorchOps, TPGroup.single())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    x = torch.randn(12, 64)
    ref = block(x)
    block.quantize()
    assert block.w13.dtype == torch.float8_e4m3fn and block.w2.dtype == torch.float8_e4m3fn
    assert block.w13_scale is not None and block.w13_scale.shape == (8, 64)
    err = float((block(x) - ref).norm() / ref.norm())
    assert 0 < err < 0.05, err


@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_fp8_engine_runs_close_to_float(tmp_path: Path, arch: str) -> None:
    from engine.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.models.fp8 import Fp8Linear
    from tests.arch_fixtures import make_tiny_arch

    model_dir = make_tiny_arch(arch, tmp_path / arch)
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0)
    results = []
    for quant in (None, "fp8"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32, quantization=quant))
        engine.add_request("r", prompt, params)
        outs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step()]
        token = outs[-1].new_token_ids[0]
        assert outs[-1].logprobs
        results.append((token, outs[-1].logprobs[0].logprob, engine))
    model = results[1][2].runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    if arch in ("mixtral", "qwen3_moe", "gpt_oss"):
        assert all(
            m.w13.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, MoEBlock)
        )
    assert abs(results[0][1] - results[1][1]) < 0.5
