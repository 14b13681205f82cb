"""Reading and checking one Hugging Face PEFT LoRA adapter (docs/lora.md).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. Every
check runs here, before an adapter can reach a slot, so a bad adapter is refused with a
message naming what is wrong (missing file, rank above ``max_lora_rank``, a module or shape
the base model does not have) instead of failing inside a step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

import torch

from engine.models.config import ModelArgs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names, grouped by the merged projection they add to (engine/models/llama.py).
SUBMODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MODULE_KIND = {m: kind for kind, mods in SUBMODULES.items() for m in mods}
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served (the message says why); a ValueError, so the
    services answer it as bad input."""


def module_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable module of the base model."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    inter = args.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter's weights on the host, float32. ``weights[(layer, module)] = (A, B)``
    with A ``[r, in]`` and B ``[out, r]`` already multiplied by the scaling (alpha / r, or
    alpha / sqrt(r) for rsLoRA), so a slot only copies them."""

    name: str
    path: str
    rank: int
    content_hash: str  # sha256 of the config and weights files
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def identity(self) -> str:
        """What KV hashes, store keys and handles carry: name and content (docs/design.md §3)."""
        return f"{self.name}:{self.content_hash}"


def content_hash(path: str) -> str:
    """sha256 over the config and weights files: the same name with new weights is
    another adapter to the KV caches."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def read_config(path: str) -> dict[str, object]:
    """The adapter's config, checked for what this engine serves."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoRAError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (only safetensors load)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {path!r}: {key}=true is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {path!r}: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {path!r}: bias={cfg.get('bias')!r} is not supported")
    return cfg


def load_adapter(name: str, path: str, args: ModelArgs, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at ``path`` against the base model ``args``; raises
    ``LoRAError`` naming the problem."""
    from safetensors import safe_open

    cfg = read_config(path)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"LoRA adapter {path!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(
            f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank {max_rank}; "
            "raise --max-lora-rank"
        )
    alpha = float(cfg.get("lora_alpha", rank))  # type: ignore[arg-type]
    scaling = alpha / (rank**0.5 if cfg.get("use_rslora") else rank)
    shapes = module_shapes(args)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.match(key)
                if m is None:
                    raise LoRAError(
                        f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA weight of an "
                        "attention or MLP projection (the only targets served)"
                    )
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in shapes:
                    raise LoRAError(f"LoRA adapter {path!r}: module {module!r} is not served")
                if layer >= args.num_layers:
                    raise LoRAError(
                        f"LoRA adapter {path!r}: layer {layer} but the base model has "
                        f"{args.num_layers} layers"
                    )
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key).float()
    except LoRAError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise LoRAError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE} ({exc})") from None
    if not halves:
        raise LoRAError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"LoRA adapter {path!r}: layer {layer} {module} has A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}; the base model needs ({rank}, {fan_in}) and "
                f"({fan_out}, {rank}) (an adapter for another base model?)"
            )
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(name, os.path.abspath(path), rank, content_hash(path), weights)
