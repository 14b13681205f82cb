"""What deterministic mode covers, checked at start-up (docs/design.md §3 "Deterministic mode").

The batch-invariant kernels exist for the dense decoder's projections, norms, attention
(torch_ref, Triton) and the LM head. A setting that would put a batch-dependent kernel
back on a row's path is refused here, naming it, rather than silently breaking the promise.
"""

from __future__ import annotations

from typing import Any


def check_deterministic(config: Any, quantized: bool) -> None:
    """ValueError naming the first setting ``config`` (an ``EngineConfig``; not imported:
    it calls this) turns on that deterministic mode does not cover."""
    refusals = (
        (config.attention_backend == "flash_attn", "attention_backend 'flash_attn'"),
        (quantized, "fp8 quantization (its GEMM picks kernels by shape)"),
        (config.tensor_parallel_size > 1, "tensor_parallel_size > 1 (the all-reduce's "
         "algorithm follows the message size)"),
        (config.pipeline_parallel_size > 1, "pipeline_parallel_size > 1"),
        (config.speculative is not None, "speculative decoding"),
        (config.enable_lora, "LoRA adapters"),
        (_is_moe(config), "mixture-of-experts models (expert batches follow the routing)"),
    )  # fmt: skip
    for refused, what in refusals:
        if refused:
            raise ValueError(f"deterministic mode does not cover {what}; turn one of them off")


def _is_moe(config: Any) -> bool:
    from engine.models.config import ModelArgs

    return bool(ModelArgs.from_hf(config.hf_config()).num_experts)
