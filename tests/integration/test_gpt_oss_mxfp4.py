"""gpt-oss's published checkpoints hold their experts in MXFP4 (engine/models/gpt_oss.py):
the engine's dequantization equals transformers' own, and an engine serving an MXFP4
checkpoint gives the greedy tokens transformers gives on the same weights dequantized
(float32, CPU). The MXFP4 checkpoint is made here from the tiny random gpt-oss: each
block of 32 values scaled by a power of two and rounded to the nearest e2m1 value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.gpt_oss import dequantize_mxfp4
from tests.arch_fixtures import make_tiny_arch

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [*prefix, K/32, 16] uint8, scales [*prefix, K/32] uint8)`` of ``w``
    ``[*prefix, K]``: per 32 values the power of two that brings the largest to <= 6."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0))
    x = g / torch.exp2(exp)
    idx = (x.abs().unsqueeze(-1) - _FP4).abs().argmin(-1)  # nearest magnitude
    code = (idx | ((x < 0).long() << 3)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp.squeeze(-1) + 127).to(torch.uint8)


def test_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(115, 135, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    assert ours.shape == (3, 10, 128)
    assert torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[..., :3])


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, the same weights dequantized in transformers' layout)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = make_tiny_arch("gpt_oss", tmp_path_factory.mktemp("oss_src"))
    packed, plain = tmp_path_factory.mktemp("oss_mxfp4"), tmp_path_factory.mktemp("oss_deq")
    tensors = load_file(str(src / "model.safetensors"))
    q_tensors, d_tensors = {}, {}
    for name, t in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())  # [E, out, in]
            q_tensors[f"{name}_blocks"], q_tensors[f"{name}_scales"] = blocks, scales
            d_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            q_tensors[name] = d_tensors[name] = t
    for out, ts in ((packed, q_tensors), (plain, d_tensors)):
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        save_file({k: v.contiguous() for k, v in ts.items()}, str(out / "model.safetensors"))
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (packed / "config.json").write_text(json.dumps(cfg))
    return packed, plain


def test_mxfp4_checkpoint_matches_transformers(mxfp4_dirs: tuple[Path, Path]) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.integration.test_arch_parity import arch_prompts, hf_greedy
    from tests.integration.test_engine_parity import _run_staggered

    packed, plain = mxfp4_dirs
    prompts = arch_prompts(7)[:4]
    expected = hf_greedy(plain, prompts, 8)
    engine = LLMEngine(EngineConfig(model=str(packed), num_kv_blocks=96, block_size=8))
    try:
        w13 = engine.runner.model.layers[0].mlp.w13  # type: ignore[union-attr]
        assert w13.dtype == torch.float32 and w13.abs().sum() > 0
        assert _run_staggered(engine, prompts, 8) == expected
    finally:
        engine.shutdown()


def test_mxfp4_is_only_for_gpt_oss() -> None:
    from engine.models.fp8_loader import resolve_quantization

    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "quantization_config": {"quant_method": "mxfp4"},
    }
    with pytest.raises(ValueError, match="gpt-oss only"):
        resolve_quantization(None, cfg)
    oss = {"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    assert resolve_quantization(None, oss) is None
    scheme = resolve_quantization("fp8", oss)
    assert scheme is not None and not scheme.from_checkpoint
