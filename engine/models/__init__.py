"""Model registry and weight loading (single or sharded safetensors, or dummy weights)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator

import torch

from engine.attention.base import AttentionBackend
from engine.distributed.tp_group import TPGroup
from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES
from engine.models.fp8 import (
    Fp8Linear,
    cast_unquantized,
    empty_fp8_projections,
    fp8_checkpoint_tensors,
    quantize_projections,
)
from engine.models.fp8_loader import Fp8Scheme
from engine.models.layer_ops import LayerOps, TorchOps
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoEBlock
from engine.models.stages import Stage

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArgs", "build_model", "get_layer_ops"]

# Every supported architecture shares one implementation; the differences (qkv bias, q/k
# norm, rope scaling, windows, soft-caps, norms, experts, MLA) are fields of ModelArgs.
# DeepSeek's subclass differs only in how its checkpoint loads.
_REGISTRY: dict[str, type[LlamaForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaForCausalLM
) | dict.fromkeys(DEEPSEEK_ARCHITECTURES, DeepseekForCausalLM)


def get_layer_ops(device: str, fused: bool, deterministic: bool = False) -> LayerOps:
    """Triton kernels on CUDA when asked for and importable, else the torch reference.
    ``deterministic``: their batch-invariant variants (docs/design.md §3 "Deterministic
    mode"); on CUDA that is always the Triton one (cuBLAS is not batch-invariant)."""
    triton_here = device.startswith("cuda") and importlib.util.find_spec("triton") is not None
    if deterministic:
        if triton_here:
            from engine.models.triton_batch_invariant import BatchInvariantTritonOps

            return BatchInvariantTritonOps
        from engine.models.batch_invariant import BatchInvariantTorchOps

        return BatchInvariantTorchOps
    if fused and triton_here:
        from engine.models.triton_ops import TritonOps

        return TritonOps
    return TorchOps


def build_model(
    args: ModelArgs,
    model_dir: str,
    load_format: str,
    backend: AttentionBackend,
    max_positions: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    fused_ops: bool = False,
    tp: TPGroup | None = None,
    quantization: Fp8Scheme | None = None,
    deterministic: bool = False,
    stage: Stage | None = None,
) -> LlamaForCausalLM:
    """``fused_ops``: Triton kernels for the element-wise work on CUDA (layer_ops.py).
    ``tp``: build and load only this rank's shard (engine/models/parallel.py).
    ``quantization``: FP8 decoder projections (engine/models/fp8.py), loaded from an FP8
    checkpoint or quantized here from the loaded (or dummy) weights.
    ``stage``: build and load only this pipeline stage's part (engine/models/stages.py).
    ``deterministic``: batch-invariant ops (``get_layer_ops``)."""
    cls = _REGISTRY[args.architecture]
    ops = get_layer_ops(device, fused_ops, deterministic)
    with torch.device(device):
        model = cls(args, backend, max_positions, ops, tp, stage)
    if load_format == "dummy":
        # Each rank draws its own shard's values (random either way: shapes set the speed).
        # (and each pipeline stage its own layers'.)
        rank = (tp.rank if tp is not None else 0) + 1000 * (stage.index if stage else 0)
        _init_dummy(model, seed + rank)
    elif quantization is not None and quantization.from_checkpoint:
        empty_fp8_projections(model, ops)
        model.load_weights(fp8_checkpoint_tensors(_iter_safetensors(model_dir), args))
    else:
        model.load_weights(_iter_safetensors(model_dir))
    if quantization is None:
        model.to(dtype=dtype)
    else:
        if not any(isinstance(m, Fp8Linear) for m in model.modules()):
            quantize_projections(model, ops)  # from the checkpoint's own precision
            for module in model.modules():
                if isinstance(module, MoEBlock):
                    module.quantize()
        cast_unquantized(model, dtype)
    # Rope tables stay float32 for accuracy; they are cast per use.
    for rope in (model.rope, model.rope_local):
        rope.cos = rope.cos.float()
        rope.sin = rope.sin.float()
    return model.eval()


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (shape is what sets speed in benchmarks), norms at one."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = gens.get(param.device)
            if gen is None:
                gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gen)


def _iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights found in {model_dir!r}")
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield key, f.get_tensor(key)
