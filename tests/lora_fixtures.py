"""LoRA test material: random PEFT adapters for the tiny Llama, and the reference outputs
of transformers + PEFT's merged model (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.model_fixtures import argmax_continuations

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    **config: Any,
) -> Path:
    """A random LoRA adapter (A and B both random, so it changes the outputs) saved with
    PEFT's ``save_pretrained`` (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        init_lora_weights=False,
        lora_dropout=0.0,
        **config,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # larger B, so each adapter moves the argmax of the tiny model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens of transformers' float32 model, with the adapter merged into it."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    return argmax_continuations(model, prompts, max_tokens)
