"""Loading at real size (engine/models/loading.py): the CPU allocator's peak while a tiny
MoE model loads in bf16, quantized to FP8 at load, or as dummy weights, stays within the
served model's bytes plus one layer in its loading precision (the model dtype, or float32
while it waits to be quantized) plus one checkpoint tensor. Building the model in float32
and casting it afterwards (what the engine did before) peaks at about twice the bf16
model, so these bounds fail for it.

The peak is the allocator's own running total (``total_allocated`` of the profiler's
allocation events), not an estimate from the parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from engine.attention.torch_ref import TorchRefAttention
from engine.models import ModelArgs, build_model
from engine.models.fp8_loader import Fp8Scheme

# Experts dominate: 8 experts of 3 x 256 x 512 per layer (12.6 MB in float32), 4 layers.
_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("load_peak")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**_SHAPE)).float().save_pretrained(str(out))
    return out


def _peak_while(fn: object) -> tuple[int, object]:
    """(peak bytes the CPU allocator held above its level at the start, fn's result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()  # type: ignore[operator]
    totals: list[tuple[int, int]] = []

    def walk(events: list) -> None:  # type: ignore[type-arg]
        for e in events:
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                f = e.extra_fields
                totals.append((e.start_time_ns, f.total_allocated, f.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    assert totals, "the profiler recorded no allocation"
    totals.sort()
    base = totals[0][1] - totals[0][2]
    return max(t for _, t, _ in totals) - base, result


def _bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def _build(model_dir: Path, load_format: str, quant: Fp8Scheme | None) -> torch.nn.Module:
    import json

    args = ModelArgs.from_hf(json.loads((model_dir / "config.json").read_text()))
    backend = TorchRefAttention(cpu_kernels=False)
    return build_model(
        args, str(model_dir), load_format, backend, 256, torch.bfloat16, "cpu",
        quantization=quant,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("load_format", "quant"),
    [("auto", None), ("auto", Fp8Scheme(from_checkpoint=False)), ("dummy", None)],
    ids=["bf16", "fp8-at-load", "dummy"],
)
def test_load_peak_is_model_plus_one_layer(moe_dir: Path, load_format: str, quant) -> None:
    peak, model = _peak_while(lambda: _build(moe_dir, load_format, quant))
    assert isinstance(model, torch.nn.Module)
    served = _bytes(model.parameters()) + _bytes(model.buffers())
    layer_params = sum(p.numel() for p in model.layers[0].parameters())  # type: ignore[index]
    loading_bytes = 4 if quant is not None else 2
    one_layer = layer_params * loading_bytes
    # The largest checkpoint tensor (float32 on disk): an expert's gate|up or the head.
    largest = max(_SHAPE["vocab_size"] * 256, 512 * 256) * 4
    assert peak <= served + one_layer + largest, (peak, served, one_layer)
    # The float32-then-cast build this replaces held every layer in float32 at once.
    assert served + one_layer + largest < served * 2
    assert all(p.dtype != torch.float32 for p in model.layers.parameters()) or quant  # type: ignore[union-attr]
    if quant is not None:
        assert model.layers[0].mlp.w13.dtype == torch.float8_e4m3fn  # type: ignore[index]
