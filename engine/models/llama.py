"""The decoder over the paged KV cache for every supported architecture: the Llama family
(Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3), Phi-3 (Llama with fused checkpoint
tensors and longrope), Gemma 2/3 (windowed and global layers, soft-caps, sandwich norms,
GeGLU; ``ModelArgs`` flags) and the MoE models (Mixtral, Qwen3-MoE, gpt-oss with its
attention sinks and biases: ``engine/models/moe.py`` replaces the MLP).

Projections are merged (q|k|v and gate|up) for fewer, larger matmuls. Under tensor
parallelism (``Shard``, engine/models/parallel.py) each merged projection holds this rank's
output columns and each o/down projection its input rows, followed by one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.tp_group import TPGroup
from engine.models.config import ModelArgs
from engine.models.deepseek_moe import DeepseekMoE
from engine.models.fp8 import Fp8Act, Fp8Linear, fusable_input
from engine.models.layer_ops import LayerOps, TorchOps
from engine.models.mla import MLAttention
from engine.models.moe import MoEBlock
from engine.models.parallel import Shard, VocabParallelEmbedding, gather_logits
from engine.models.rope import RotaryEmbedding
from engine.models.stages import Stage
from engine.models.weights import load_checkpoint


class LayerLoRA(Protocol):
    """What a layer's LoRA view does (engine/lora/slots.py ``LayerLoRA``): add the step's
    LoRA term of ``x`` to a projection's output ``out`` (``kind``: qkv, o, gate_up, down)."""

    def add(self, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


def _project(ops: LayerOps, proj: nn.Linear | Fp8Linear, x: torch.Tensor | Fp8Act) -> torch.Tensor:
    """``proj(x)`` computed by ``ops`` (a one-launch GEMV at decode batch sizes on a GPU);
    the ``nn.Linear`` only holds the parameters, so weight loading is unchanged. An
    ``Fp8Linear`` (quantized model, engine/models/fp8.py) picks its own FP8 path, and takes
    an input its producer already quantized (``Fp8Act``, the fused FP8 kernels)."""
    if isinstance(proj, Fp8Linear):
        return proj(x)
    assert isinstance(x, torch.Tensor), "only an Fp8Linear takes a quantized input"
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

    def quant_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[Fp8Act, torch.Tensor]:
        """``add_forward`` (``forward`` when ``residual`` is None, the stream then being
        ``x``) with the norm's output quantized per token for an FP8 projection, in one
        kernel (engine/models/triton_fp8_fused.py)."""
        from engine.models.triton_fp8_fused import rms_norm_fp8

        return rms_norm_fp8(x, residual, self.weight, self.eps), (
            x if residual is None else residual
        )


class Attention(nn.Module):
    def __init__(
        self,
        shard: Shard,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        window: int = 0,
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
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_proj_bias)
        # gpt-oss: one sink logit per (this rank's) query head (AttentionBackend.forward).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if args.attn_sinks else None
        ops = rope.ops
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.scale = args.attn_scale or args.head_dim**-0.5
        # Per layer: the sliding window (0 = global) and the score soft-cap (0 = none).
        self.window = window
        self.softcap = args.attn_softcap
        self.lora: LayerLoRA | None = None  # set when LoRA is on (engine/lora/slots.py)

    def forward(
        self,
        x: torch.Tensor | Fp8Act,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = _project(self.rope.ops, self.qkv_proj, x)
        if self.lora is not None:
            assert isinstance(x, torch.Tensor)
            qkv = self.lora.add("qkv", x, qkv)
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
            out = self.backend.forward_prewritten(
                q, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap,
                sinks=self.sinks,
            )  # fmt: skip
        else:
            q, k = self.rope(positions, q, k)
            out = self.backend.forward(
                q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap,
                sinks=self.sinks,
            )  # fmt: skip
        attn = out.reshape(-1, self.q_size)
        out = _project(self.rope.ops, self.o_proj, attn)
        if self.lora is not None:
            out = self.lora.add("o", attn, out)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    def __init__(self, shard: Shard, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        hidden, inter = shard.args.hidden_size, shard.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tp = tp
        self.gelu = shard.args.hidden_act == "gelu_tanh"
        self.lora: LayerLoRA | None = None  # set when LoRA is on (engine/lora/slots.py)
        self.fp8_fused = False  # quantize down_proj's input in the SiLU kernel (fp8.py)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        gate_up = _project(self.ops, self.gate_up_proj, x)
        if self.lora is not None:
            assert isinstance(x, torch.Tensor)
            gate_up = self.lora.add("gate_up", x, gate_up)
        act = self._act(gate_up)
        out = _project(self.ops, self.down_proj, act)
        if self.lora is not None:
            assert isinstance(act, torch.Tensor)
            out = self.lora.add("down", act, out)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor | Fp8Act:
        if self.gelu:
            return gelu_tanh_mul(gate_up)
        if (
            self.fp8_fused
            and self.lora is None
            and fusable_input(self.down_proj, gate_up[:, : gate_up.shape[-1] // 2])
        ):
            from engine.models.triton_fp8_fused import silu_mul_fp8

            return silu_mul_fp8(gate_up)
        return self.ops.silu_mul(gate_up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        shard: Shard,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        index: int,
    ) -> None:
        super().__init__()
        args = shard.args
        ops = rope.ops
        window = args.layer_windows[index] if args.layer_windows else 0
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.self_attn: Attention | MLAttention
        if args.mla is not None:  # DeepSeek: the latent cache (engine/models/mla.py)
            self.self_attn = MLAttention(shard, rope, tp)
        else:
            self.self_attn = Attention(shard, rope, backend, tp, window)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.mlp: MLP | MoEBlock
        if args.is_moe and index not in args.dense_layers:
            moe = DeepseekMoE if args.routing is not None else MoEBlock
            self.mlp = moe(shard, ops, tp)
        else:
            self.mlp = MLP(shard, ops, tp)
        # Gemma: the attention and MLP outputs are normed before they join the residual
        # stream (post_attention_layernorm then plays that role), and the MLP's input norm
        # is pre_feedforward_layernorm.
        self.sandwich = args.sandwich_norms
        # Quantize the FP8 projections' inputs in the norms' kernels (enable_fp8_fusions).
        self.fp8_fused = False
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)

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
        attn, mlp = self.self_attn, self.mlp
        h: torch.Tensor | Fp8Act
        if (
            self.fp8_fused
            and isinstance(attn, Attention)  # MLA runs unquantized (engine/models/support.py)
            and attn.lora is None
            and fusable_input(attn.qkv_proj, x, residual)
        ):
            h, residual = self.input_layernorm.quant_forward(x, residual)
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        out = attn(h, positions, kv_cache, meta)
        if self.sandwich:
            out = self.post_attention_layernorm(out)
            out, residual = self.pre_feedforward_layernorm.add_forward(out, residual)
            return self.post_feedforward_layernorm(self.mlp(out)), residual
        if (
            self.fp8_fused
            and isinstance(mlp, MLP)
            and mlp.lora is None
            and fusable_input(mlp.gate_up_proj, out, residual)
        ):
            h, residual = self.post_attention_layernorm.quant_forward(out, residual)
        else:
            h, residual = self.post_attention_layernorm.add_forward(out, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        max_positions: int,
        ops: LayerOps = TorchOps,
        tp: TPGroup | None = None,
        stage: Stage | None = None,
    ) -> None:
        """``tp``: this rank's group (None: one process holds the whole model).
        ``stage``: the pipeline stage this module is (None: every layer; docs/design.md
        §3 "Pipeline parallelism"): only its layers, the embedding on the first stage,
        the final norm and LM head on the last."""
        super().__init__()
        self.args = args
        self.stage = stage = stage or Stage.whole(args.num_layers)
        self.tp = tp or TPGroup.single()
        self.shard = shard = Shard(args, self.tp.rank, self.tp.size)
        rope = RotaryEmbedding(
            args.head_dim, max_positions, args.rope_theta, args.rope_scaling, ops
        )
        # Gemma 3's windowed layers rotate with their own (local, unscaled) base.
        local = rope
        if args.local_rope_theta is not None:
            local = RotaryEmbedding(args.head_dim, max_positions, args.local_rope_theta, {}, ops)
        self.rope_local = local
        self.ops = ops  # the LM head's matmul (``LayerOps.logits``)
        self.embed_tokens = VocabParallelEmbedding(shard, self.tp) if stage.is_first else None
        self.layers = nn.ModuleList(
            DecoderLayer(shard, local if i in args.local_layers else rope, backend, self.tp, i)
            for i in stage.layers
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops) if stage.is_last else None
        self.lm_head = (
            nn.Linear(args.hidden_size, shard.vocab_per_rank, bias=False) if stage.is_last else None
        )
        # The head is the embedding's own tensor only when one stage holds both.
        self.ties_head = args.tie_word_embeddings and stage.size == 1
        if self.ties_head:
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[union-attr]
        self.rope = rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of the flattened batch. A pipeline stage
        (``self.stage``) that is not the first starts from ``carried`` (the previous
        stage's ``[2, num_tokens, hidden]``: its last output and the residual stream; zeros
        when None, for a profiling pass) instead of ``input_ids``, and one that is not the
        last returns that pair for the next stage instead of the normed hidden states.
        ``kv_cache`` holds this stage's layers only."""
        residual: torch.Tensor | None = None
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)
            if self.args.embed_scale:
                # Gemma: sqrt(hidden) rounded to the model dtype, as transformers does.
                # (a Python float: nothing on the host inside a captured CUDA graph)
                x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype).item()
        else:
            if carried is None:
                dtype = next(self.layers.parameters()).dtype  # the first norm: model dtype
                shape = (2, positions.shape[0], self.args.hidden_size)
                carried = torch.zeros(shape, dtype=dtype, device=positions.device)
            x, residual = carried[0], carried[1]
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, kv_cache[i], meta)
        if self.norm is None:
            assert residual is not None  # a stage has at least one layer
            return torch.stack((x, residual))
        if residual is None:  # a model with no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def enable_fp8_fusions(self) -> bool:
        """Quantize each FP8 projection's input inside the kernel that makes it (RMSNorm,
        SiLU·mul; engine/models/triton_fp8_fused.py) instead of in a launch of its own.
        Only with the Triton layer ops, whose rounding the fused kernels reproduce; returns
        whether it is on."""
        if self.ops.name != "triton":
            return False
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.fp8_fused = True
            if isinstance(layer.mlp, MLP):
                layer.mlp.fp8_fused = True
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` (all-gathered from the ranks' vocab slices)."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        local = self.ops.logits(hidden, self.lm_head.weight)
        logits = gather_logits(self.tp, local, self.args.vocab_size).float()
        cap = self.args.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the merged layout; every parameter must be
        set (engine/models/weights.py)."""
        load_checkpoint(self, weights)
