"""Checks of the engine's LoRA settings (vLLM's names; docs/lora.md)."""

from __future__ import annotations

from typing import Any

MAX_LORA_RANK_LIMIT = 512


def check_lora_settings(config: Any) -> None:
    """ValueError naming the setting when an ``EngineConfig``'s LoRA settings are
    inconsistent (typed loosely: engine.py imports this module)."""
    if config.max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {config.max_loras}")
    if not 1 <= config.max_lora_rank <= MAX_LORA_RANK_LIMIT:
        raise ValueError(
            f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {config.max_lora_rank}"
        )
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError(
            f"max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras ({config.max_loras})"
        )
    if not config.lora_wait_timeout > 0:
        raise ValueError(f"lora_wait_timeout must be > 0 s, got {config.lora_wait_timeout}")
    if not config.enable_lora:
        if config.lora_modules:
            raise ValueError("lora_modules needs enable_lora")
        return
    if config.tensor_parallel_size > 1:
        raise ValueError("enable_lora does not work with tensor_parallel_size > 1 yet")
    names = [name for name, _ in config.lora_modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules names must be unique, got {names}")
