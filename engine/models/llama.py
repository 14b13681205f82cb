"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

Projections are merged (q|k|v and gate|up) for fewer, larger matmuls. Under tensor
parallelism (``Shard``, engine/models/parallel.py) each merged projection holds this rank's
output columns and each o/down projection its input rows, followed by one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.config import ModelArgs
from engine.models.fp8 import Fp8Linear
from engine.models.layer_ops import LayerOps, TorchOps
from engine.models.parallel import Shard, VocabParallelEmbedding, gather_logits
from engine.models.rope import RotaryEmbedding
from engine.tp_group import TPGroup


def _project(ops: LayerOps, proj: nn.Linear | Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)`` computed by ``ops`` (a one-launch GEMV at decode batch sizes on a GPU);
    the ``nn.Linear`` only holds the parameters, so weight loading is unchanged. An
    ``Fp8Linear`` (quantized model, engine/models/fp8.py) picks its own FP8 path."""
    if isinstance(proj, Fp8Linear):
        return proj(x)
    return ops.linear(x, proj.weight, proj.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of ``residual + x``, and that sum (the residual stream; may reuse
        ``residual``'s storage)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self, shard: Shard, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPGroup
    ) -> None:
        super().__init__()
        args = shard.args
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shard.num_heads,
            shard.num_kv_heads,
            args.head_dim,
        )
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.tp = tp
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        ops = rope.ops
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.scale = args.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = _project(self.rope.ops, self.qkv_proj, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        ops = self.rope.ops
        if ops.fuses_kv_write and self.backend.accepts_prewritten_kv:
            # One kernel rotates q/k and stores k/v in the cache: no separate write launch.
            q = ops.rope_store_kv(
                positions, q, k, v, self.rope.cos, self.rope.sin, kv_cache, meta.slot_mapping
            )
            out = self.backend.forward_prewritten(q, kv_cache, meta, self.scale)
        else:
            q, k = self.rope(positions, q, k)
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        out = _project(self.rope.ops, self.o_proj, out.reshape(-1, self.q_size))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class MLP(nn.Module):
    def __init__(self, shard: Shard, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        hidden, inter = shard.args.hidden_size, shard.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = _project(self.ops, self.gate_up_proj, x)
        out = _project(self.ops, self.down_proj, self.ops.silu_mul(gate_up))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(
        self, shard: Shard, rope: RotaryEmbedding, backend: AttentionBackend, tp: TPGroup
    ) -> None:
        super().__init__()
        args = shard.args
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, rope.ops)
        self.self_attn = Attention(shard, rope, backend, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, rope.ops)
        self.mlp = MLP(shard, rope.ops, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous sublayer's output and ``residual`` the stream it adds to
        (None before the first layer). Returns this layer's MLP output and the stream
        without that output added: the next norm adds it, fused with the norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        max_positions: int,
        ops: LayerOps = TorchOps,
        tp: TPGroup | None = None,
    ) -> None:
        """``tp``: this rank's group (None: one process holds the whole model)."""
        super().__init__()
        self.args = args
        self.tp = tp or TPGroup.single()
        self.shard = shard = Shard(args, self.tp.rank, self.tp.size)
        rope = RotaryEmbedding(
            args.head_dim, max_positions, args.rope_theta, args.rope_scaling, ops
        )
        self.embed_tokens = VocabParallelEmbedding(shard, self.tp)
        self.layers = nn.ModuleList(
            DecoderLayer(shard, rope, backend, self.tp) for _ in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.lm_head = nn.Linear(args.hidden_size, shard.vocab_per_rank, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the flattened batch."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_cache[i], meta)
        if residual is None:  # a model with no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` (all-gathered from the ranks' vocab slices)."""
        return gather_logits(self.tp, self.lm_head(hidden), self.args.vocab_size).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the merged layout; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        a, sh = self.args, self.shard
        q_size, kv_size = sh.num_heads * a.head_dim, sh.num_kv_heads * a.head_dim
        inter = sh.intermediate_size
        shards = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        for vocab_param in (self.embed_tokens.weight, self.lm_head.weight):
            vocab_param.data.zero_()  # the vocab slice's padding rows stay zero
        for hf_name, full in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and a.tie_word_embeddings:
                continue
            tensor = sh.slice_checkpoint(name, full)
            for shard, (merged, offset, size) in shards.items():
                if f".{shard}." in name:
                    name = name.replace(shard, merged)
                    param = params[name]
                    param.data[offset : offset + size].copy_(tensor)
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                dest: torch.Tensor = params[name].data
                if name in ("embed_tokens.weight", "lm_head.weight"):
                    dest = dest[: tensor.shape[0]]  # the last vocab slice may be short
                dest.copy_(tensor)
                loaded.add(name)
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if "qkv_proj.weight" in name or "qkv_proj.bias" in name:
                base = name
                need = [f"{base}#q_proj", f"{base}#k_proj", f"{base}#v_proj"]
            elif "gate_up_proj" in name:
                need = [f"{name}#gate_proj", f"{name}#up_proj"]
            else:
                need = [name]
            missing += [n for n in need if n not in loaded]
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {missing[:5]}{'...' if len(missing) > 5 else ''}"
            )
