"""GGUF → Hugging Face directory conversion (the slow half of `pdserve models pull`).

Imports torch and transformers at call time only, so importing this module stays cheap.
transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the dequantised
weights are loaded into a fresh model built from the GGUF's config and saved from there.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Parameters a tied-embedding checkpoint legitimately lacks after load_state_dict.
_TIED_ONLY = {"lm_head.weight"}


def convert_gguf_to_hf(
    gguf_dir: Path, gguf_file: str, out_dir: Path, dtype: str = "bfloat16"
) -> None:
    """Write a loadable Hugging Face causal-LM directory for ``gguf_dir/gguf_file`` into
    ``out_dir`` (which must exist and be empty): config.json, generation_config.json,
    model.safetensors in ``dtype``, tokenizer.json, tokenizer_config.json (with the chat
    template embedded as well, for older transformers) and chat_template.jinja.

    Raises RuntimeError when the GGUF's tensors do not map onto the model's parameters.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype name such as 'bfloat16', got {dtype!r}")
    logger.info("converting %s/%s to a Hugging Face directory (%s)", gguf_dir, gguf_file, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    # A quantization_config makes save_pretrained refuse; the weights will be plain.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    # The dequantising reader behind from_pretrained(gguf_file=...), called directly: the
    # from_pretrained route demands `accelerate`, which nothing else here needs. It maps
    # GGUF names onto `model`'s parameters and undoes llama.cpp's q/k row permutation.
    parsed = load_gguf_checkpoint(
        str(gguf_dir / gguf_file), return_tensors=True, model_to_load=model
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    missing = set(result.missing_keys) - _TIED_ONLY
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF tensors do not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    if result.missing_keys and not getattr(config, "tie_word_embeddings", False):
        raise RuntimeError("lm_head.weight is missing but the config does not tie embeddings")
    model.tie_weights()
    _set_generation_tokens(model, tokenizer)
    model.eval()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    _make_portable(out_dir, tokenizer.chat_template)
    _open_permissions(out_dir)


def _set_generation_tokens(model: Any, tokenizer: Any) -> None:
    """Copy bos/eos/pad into config and generation config; pad falls back to eos because
    batched generation needs one and SmolLM2 ships none."""
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if eos is None:
        raise RuntimeError("the GGUF tokenizer defines no EOS token")
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = bos
        cfg.eos_token_id = eos
        cfg.pad_token_id = pad


def _make_portable(out_dir: Path, template: str | None) -> None:
    """Let transformers 4.x read what transformers 5 wrote: 4.x knows neither the
    ``TokenizersBackend`` class (5.x maps ``PreTrainedTokenizerFast`` onto it), nor
    chat_template.jinja, nor ``rope_parameters`` without a top-level ``rope_theta``."""
    if not template:
        raise RuntimeError("the GGUF carries no chat template")
    jinja = out_dir / "chat_template.jinja"
    if not jinja.exists():
        jinja.write_text(template, encoding="utf-8")

    def edit(name: str, update: dict[str, Any]) -> None:
        path = out_dir / name
        data = json.loads(path.read_text(encoding="utf-8"))
        data.update(update)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    edit(
        "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template},
    )
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    update: dict[str, Any] = {}
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        update["rope_theta"] = rope["rope_theta"]
    eps = config.get("rms_norm_eps")
    if isinstance(eps, float):
        # GGUF stores eps as float32 (9.9999997e-06); the model's value is the short decimal.
        update["rms_norm_eps"] = float(f"{eps:.7g}")
    edit("config.json", update)


def _open_permissions(out_dir: Path) -> None:
    """mkdtemp makes the staging dir 0700 and safetensors writes 0600; a shared model
    cache should be readable like any other cached download (subject to the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    out_dir.chmod(0o755 & ~umask)
    for path in out_dir.iterdir():
        path.chmod(0o644 & ~umask)
