"""Start-up refusals for model/feature combinations this engine does not run, each naming
the combination (docs/models.md has the supported-models table)."""

from __future__ import annotations

from engine.models.config import ModelArgs

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
    if device.startswith("cuda") and (hd % 8 or not 16 <= hd <= 256):
        raise ValueError(
            f"{arch} with head_dim {hd} on CUDA is not supported: the Triton attention "
            "kernels need a head_dim that is a multiple of 8 in [16, 256] (run it on the CPU)"
        )
