"""Hugging Face checkpoint tensors into the engine's merged layout (``LlamaForCausalLM``).

Name mapping per family before anything is sliced for tensor parallelism:

* Phi-3 stores q|k|v and gate|up fused (``qkv_proj``, ``gate_up_proj``); they are split
  back into the Llama names so tensor-parallel slicing (engine/models/parallel.py) works
  on each part, then merged again into this rank's ``qkv_proj`` / ``gate_up_proj``.
* Mixtral's experts are ``block_sparse_moe.experts.E.w1|w3|w2`` (gate, up, down) and its
  router ``block_sparse_moe.gate``; they take Qwen3-MoE's names
  (``mlp.experts.E.gate_proj|up_proj|down_proj``, ``mlp.gate``).
* Per-expert tensors are copied into the stacked ``w13`` ``[experts, 2 * inter, hidden]``
  and ``w2`` ``[experts, hidden, inter]`` (engine/models/moe.py).
* Gemma's norms scale by ``1 + weight``; the 1 is added here, once, so every norm kernel
  stays ``weight * normalise(x)``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.models.arch import GEMMA_ARCHITECTURES
from engine.models.gpt_oss import ARCH as GPT_OSS
from engine.models.gpt_oss import gpt_oss_tensors

# The model is ``engine.models.llama.LlamaForCausalLM`` (not imported: it imports this).
LlamaForCausalLM = Any

_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Experts that arrive already stacked (gpt-oss, engine/models/gpt_oss.py).
_STACKED = re.compile(r"^layers\.\d+\.mlp\.(w13|w2)$")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_names(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under Llama / Qwen3-MoE names (the module docstring)."""
    a = model.args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    if a.architecture == GPT_OSS:
        weights = gpt_oss_tensors(weights)  # stacked experts, MXFP4 dequantized
    for name, t in weights:
        if name.endswith(".qkv_proj.weight") or name.endswith(".qkv_proj.bias"):
            base, _, leaf = name.rpartition(".qkv_proj.")
            for part, piece in zip(
                ("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]), strict=True
            ):
                yield f"{base}.{part}.{leaf}", piece
        elif name.endswith(".gate_up_proj.weight") and ".experts." not in name:
            base = name.removesuffix(".gate_up_proj.weight")
            gate, up = t.chunk(2, dim=0)
            yield f"{base}.gate_proj.weight", gate
            yield f"{base}.up_proj.weight", up
        elif ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for old, new in _MIXTRAL.items():
                name = name.replace(f".{old}.", f".{new}.")
            yield name, t
        else:
            yield name, t


def load_checkpoint(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy the checkpoint into ``model``'s (already materialized) parameters;
    ``ValueError`` for an unexpected tensor or a parameter left unset. The layer-by-layer
    load of ``engine/models/loading.py`` drives ``CheckpointCopier`` itself."""
    copier = CheckpointCopier(model)
    copier.refresh(model.named_parameters())
    copier.zero_vocab_padding()
    for hf_name, name, tensor in checkpoint_entries(model, weights):
        copier.copy(hf_name, name, tensor)
    copier.check(list(copier.params))


def checkpoint_entries(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(hf name, this module's parameter-space name, tensor)`` of every checkpoint
    tensor this model (or pipeline stage) keeps, in the order given."""
    a = model.args
    for hf_name, full in hf_names(model, weights):
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and a.tie_word_embeddings:
            continue
        # A pipeline stage keeps its own layers (renumbered from 0), and the embedding,
        # norm and head only where it holds them (engine/models/stages.py).
        local = model.stage.local_name(name, a.tie_word_embeddings)
        if local is not None:
            yield hf_name, local, full


class CheckpointCopier:
    """Copies named checkpoint tensors into the merged layout and records which parts of
    which parameter were set. ``params`` is refreshed as parts of the model are
    materialized (the layer-by-layer load replaces meta parameters by real ones)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.params: dict[str, nn.Parameter] = {}
        self.loaded: set[str] = set()
        a, sh = model.args, model.shard
        q_size, kv_size = sh.num_heads * a.head_dim, sh.num_kv_heads * a.head_dim
        inter = sh.intermediate_size
        self.shards = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        self.gemma = a.architecture in GEMMA_ARCHITECTURES

    def refresh(self, named: Iterable[tuple[str, nn.Parameter]], prefix: str = "") -> None:
        self.params.update((prefix + n, p) for n, p in named)

    def drop(self, prefix: str) -> None:
        """Forget the parameters under ``prefix`` (a finished layer: quantizing it frees
        its float32 tensors only once nothing here holds them)."""
        self.params = {n: p for n, p in self.params.items() if not n.startswith(prefix)}

    def zero_vocab_padding(self) -> None:
        for vocab_module in (self.model.embed_tokens, self.model.lm_head):
            if vocab_module is not None:  # a pipeline stage may hold neither
                vocab_module.weight.data.zero_()  # the vocab slice's padding rows stay zero

    def copy(self, hf_name: str, name: str, full: torch.Tensor) -> None:
        params, loaded = self.params, self.loaded
        expert = _EXPERT.match(name)
        if expert is not None:
            _load_expert(self.model, params, expert, full, loaded)
            return
        stacked = _STACKED.match(name)
        if stacked is not None:
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            params[name].data.copy_(self.model.shard.slice_checkpoint(name, full))
            experts = range(self.model.args.num_experts)
            if stacked.group(1) == "w2":
                loaded.update(f"{name}#{e}" for e in experts)
            else:
                loaded.update(f"{name}#{e}.{p}" for e in experts for p in ("gate_proj", "up_proj"))
            return
        tensor = self.model.shard.slice_checkpoint(name, full)
        if self.gemma and name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        for shard, (merged, offset, size) in self.shards.items():
            if f".{shard}." in name:
                name = name.replace(shard, merged)
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                params[name].data[offset : offset + size].copy_(tensor)
                loaded.add(f"{name}#{shard}")
                return
        if name not in params:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        dest: torch.Tensor = params[name].data
        if name in ("embed_tokens.weight", "lm_head.weight"):
            dest = dest[: tensor.shape[0]]  # the last vocab slice may be short
        dest.copy_(tensor)
        loaded.add(name)

    def check(self, names: Iterable[str]) -> None:
        """``ValueError`` naming the parameters among ``names`` the checkpoint left unset."""
        _check_complete(self.model, names, self.loaded)


def _load_expert(
    model: LlamaForCausalLM,
    params: dict[str, nn.Parameter],
    match: re.Match[str],
    full: torch.Tensor,
    loaded: set[str],
) -> None:
    """One expert's gate/up/down into the stacked tensors (this rank's slice of its
    intermediate size under tensor parallelism: Megatron-style expert sharding)."""
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    sh = model.shard
    inter = sh.moe_intermediate_size
    if expert >= model.args.num_experts or f"{prefix}.w13" not in params:
        raise ValueError(f"unexpected expert weight {match.group(0)!r} in checkpoint")
    lo = sh.rank * inter
    if proj == "down_proj":
        params[f"{prefix}.w2"].data[expert].copy_(full[:, lo : lo + inter])
        loaded.add(f"{prefix}.w2#{expert}")
        return
    offset = 0 if proj == "gate_proj" else inter
    params[f"{prefix}.w13"].data[expert, offset : offset + inter].copy_(full[lo : lo + inter])
    loaded.add(f"{prefix}.w13#{expert}.{proj}")


def _check_complete(model: LlamaForCausalLM, params: Iterable[str], loaded: set[str]) -> None:
    missing = []
    experts = range(model.args.num_experts)
    for name in params:
        if name == "lm_head.weight" and model.ties_head:
            continue
        if "qkv_proj.weight" in name or "qkv_proj.bias" in name:
            need = [f"{name}#q_proj", f"{name}#k_proj", f"{name}#v_proj"]
        elif "gate_up_proj" in name:
            need = [f"{name}#gate_proj", f"{name}#up_proj"]
        elif name.endswith(".mlp.w13"):
            need = [f"{name}#{e}.{p}" for e in experts for p in ("gate_proj", "up_proj")]
        elif name.endswith(".mlp.w2"):
            need = [f"{name}#{e}" for e in experts]
        else:
            need = [name]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
