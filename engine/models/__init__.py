"""Model registry and building (weights from single or sharded safetensors, or dummy
weights, loaded layer by layer: engine/models/loading.py)."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend
from engine.distributed.tp_group import TPGroup
from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArgs
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES
from engine.models.fp8 import empty_fp8_projections, fp8_checkpoint_tensors, use_tensor_scales
from engine.models.fp8_loader import Fp8Scheme
from engine.models.layer_ops import LayerOps, TorchOps
from engine.models.llama import LlamaForCausalLM
from engine.models.loading import LayerwiseLoader, iter_safetensors
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
    # On the meta device, then filled layer by layer: the load peak is the served model
    # plus one layer (engine/models/loading.py).
    with torch.device("meta"):
        model = cls(args, backend, max_positions, ops, tp, stage)
    from_checkpoint = quantization is not None and quantization.from_checkpoint
    if from_checkpoint:
        empty_fp8_projections(model, ops)
    quantize_ops = ops if quantization is not None and not from_checkpoint else None
    per_tensor = quantization is not None and quantization.tensor_scales
    loader = LayerwiseLoader(model, device, dtype, quantize_ops, per_tensor)
    if load_format == "dummy":
        # Each rank draws its own shard's values (random either way: shapes set the speed).
        # (and each pipeline stage its own layers'.)
        rank = (tp.rank if tp is not None else 0) + 1000 * (stage.index if stage else 0)
        loader.dummy(seed + rank)
    else:
        weights = iter_safetensors(model_dir)
        if from_checkpoint:
            weights = fp8_checkpoint_tensors(weights, args)
        if type(model).load_weights is LlamaForCausalLM.load_weights:
            loader.load(weights)
        else:  # its own checkpoint loader (DeepSeek): every layer allocated first
            loader.load_whole(weights, model.load_weights)
    if from_checkpoint and per_tensor:
        use_tensor_scales(model)  # after loading: q, k, v (gate, up) scales are all in
    return model.eval()
