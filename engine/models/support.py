"""Start-up refusals for model/feature combinations this engine does not run, each naming
the combination (docs/models.md has the supported-models table)."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelArgs
from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES

# Architectures whose checkpoint tensors carry the Llama names one to one, so a
# compressed-tensors FP8 checkpoint's per-projection scales map onto the merged layout.
_FP8_CHECKPOINT_ARCHS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def check_combination(args: ModelArgs, fp8_checkpoint: bool, device: str) -> None:
    """``ValueError`` for a combination of ``args``' architecture with a feature that is
    not supported."""
    arch = args.architecture
    if fp8_checkpoint and arch not in _FP8_CHECKPOINT_ARCHS:
        raise ValueError(
            f"FP8 checkpoints are not supported for {arch} (fused or per-expert tensors); "
            "load its bf16 checkpoint with quantization='fp8' to quantize at load"
        )
    hd = args.head_dim
    # MLA attends in its own module (engine/models/mla.py), not the Triton kernels.
    if args.mla is None and device.startswith("cuda") and (hd % 8 or not 16 <= hd <= 256):
        raise ValueError(
            f"{arch} with head_dim {hd} on CUDA is not supported: the Triton attention "
            "kernels need a head_dim that is a multiple of 8 in [16, 256] (run it on the CPU)"
        )


def check_mla_settings(config: Any) -> None:
    """``ValueError`` naming the setting that a DeepSeek (MLA) model does not run with yet
    (``config``: an ``EngineConfig``, typed loosely: engine/config imports this module).
    The latent cache and attention (engine/models/mla.py) are one process's, in the model
    dtype; the MLA projections are read as plain weights."""
    archs = config.hf_config().get("architectures") or []
    if not archs or archs[0] not in DEEPSEEK_ARCHITECTURES:
        return
    refused = {
        "tensor_parallel_size > 1": config.tensor_parallel_size > 1,
        "kv_cache_dtype fp8": config.kv_cache_dtype == "fp8",
        "quantization": bool(config.quantization),
        "enable_lora": bool(config.enable_lora),
        "deterministic": bool(config.deterministic),
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(
            f"{archs[0]} (multi-head latent attention) does not run with {', '.join(bad)} "
            "yet (docs/models.md)"
        )
