"""DeepSeek-V2/V3 checkpoint tensors into the engine's modules (engine/models/mla.py,
engine/models/deepseek_moe.py).

* The rope part of every query head (``q_proj`` or ``q_b_proj`` rows) and the rope key
  rows of ``kv_a_proj_with_mqa`` are stored for DeepSeek's interleaved-pair rotation;
  they are permuted here (even dimensions first, then odd), once, so the engine's
  "rotate half" rope computes the same dot products.
* Dense and shared-expert ``gate_proj``/``up_proj`` are merged into ``gate_up_proj``;
  routed experts go into the stacked ``w13``/``w2`` as for the other MoE models.
* Layers past ``num_hidden_layers`` (V3's multi-token-prediction layer) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from engine.models.weights import _EXPERT, _check_complete, _load_expert

_LAYER = re.compile(r"^layers\.(\d+)\.")


def interleaved_to_half(rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Reorder the last ``rope_dim`` of every group of rows from pairs ``(x0, x1), (x2,
    x3), ...`` to ``(x0, x2, ...) | (x1, x3, ...)``; ``rows [groups * dim, ...]`` is
    viewed as ``[groups, dim, ...]`` with the rope rows last in each group."""
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    return rows[..., order, :] if rows.dim() > 1 else rows[..., order]


def _permute_rope(name: str, t: torch.Tensor, model: Any) -> torch.Tensor:
    m = model.args.mla
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        grouped = t.view(-1, m.qk_head_dim, t.shape[-1])
        nope, pe = grouped.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=1)
        return torch.cat((nope, interleaved_to_half(pe, m.qk_rope_head_dim)), dim=1).view_as(t)
    if ".self_attn.kv_a_proj_with_mqa." in name:
        c, pe = t.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=0)
        return torch.cat((c, interleaved_to_half(pe, m.qk_rope_head_dim)), dim=0)
    return t


def load_deepseek(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy the checkpoint into ``model`` (a ``DeepseekForCausalLM``); ``ValueError`` for
    an unexpected tensor or a parameter left unset."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    a = model.args
    for hf_name, full in weights:
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and a.tie_word_embeddings):
            continue
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= a.num_layers:
            continue  # V3's multi-token-prediction layer: not served
        local = model.stage.local_name(name, a.tie_word_embeddings)
        if local is None:
            continue
        expert = _EXPERT.match(local)
        if expert is not None:
            _load_expert(model, params, expert, full, loaded)
            continue
        tensor = _permute_rope(local, full, model)
        for part in ("gate_proj", "up_proj"):
            if f".{part}." in local:
                merged = local.replace(part, "gate_up_proj")
                if merged not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                half = params[merged].shape[0] // 2
                offset = 0 if part == "gate_proj" else half
                params[merged].data[offset : offset + half].copy_(tensor)
                loaded.add(f"{merged}#{part}")
                break
        else:
            if local not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            params[local].data.copy_(tensor)
            loaded.add(local)
    _check_complete(model, params, loaded)
