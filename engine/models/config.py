"""Architecture parameters read from a Hugging Face config.json.

One ``ModelArgs`` describes every supported architecture: the Llama family's flags (qkv
bias, q/k norm, rope scaling) plus the per-family parts read by ``engine/models/arch.py``
(Phi-3's longrope, Gemma's sliding/global layers, soft-caps and norms, the MoE sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.models.arch import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES, arch_fields
from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES, GroupedRouting, MLAArgs

__all__ = ["GEMMA_ARCHITECTURES", "MOE_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "ModelArgs"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
    "GptOssForCausalLM",
)


@dataclass(frozen=True, slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, object] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer: its attention window in tokens (0 = global attention). A query at
    # position p sees keys in (p - window, p] (Hugging Face's sliding-window mask).
    layer_windows: tuple[int, ...] = ()
    # Rope of the windowed layers where it differs from the global one (Gemma 3's local
    # base, unscaled); None: every layer uses rope_theta/rope_scaling.
    local_rope_theta: float | None = None
    local_layers: tuple[int, ...] = ()
    # The MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
    hidden_act: str = "silu"
    # Gemma: tanh soft-caps (0 = none) of the attention scores and the final logits,
    # 1/sqrt(query_pre_attn_scalar) as the attention scale, embeddings times
    # sqrt(hidden), norms after attention and the MLP as well as before.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale: float | None = None
    embed_scale: bool = False
    sandwich_norms: bool = False
    # Mixture of experts (0 experts: a dense MLP in every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the top-k routing weights to sum to one (Mixtral: always; Qwen3-MoE:
    # its norm_topk_prob).
    norm_topk_prob: bool = True
    # Layers that keep a dense MLP in an MoE model (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V2/V3 (engine/models/deepseek_args.py): multi-head latent attention, whose
    # cache holds one latent per token (then ``num_kv_heads`` is 1 and ``head_dim`` the
    # rope part's), and the MoE's grouped routing with shared experts.
    mla: MLAArgs | None = None
    routing: GroupedRouting | None = None
    # gpt-oss (engine/models/gpt_oss.py): a learned sink logit per attention head, o_proj
    # with a bias, a router with a bias, experts with biases and the clamped SwiGLU
    # (``swiglu_limit`` > 0; 0 = plain SiLU·mul).
    attn_sinks: bool = False
    o_proj_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = str(archs[0]) if isinstance(archs, list) and archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            hint = ""
            if arch == "Gemma3ForConditionalGeneration":
                hint = " (the Gemma 3 text models, Gemma3ForCausalLM, are supported)"
            raise ValueError(
                f"model architecture {arch or '(none)'!r} is not supported{hint}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        num_layers = int(cfg["num_hidden_layers"])
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        # The family's own fields may replace the generic ones (DeepSeek's head sizes).
        return cls(**(fields | arch_fields(arch, cfg, num_layers)))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_planes(self) -> int:
        """Planes of the paged cache per layer: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def kv_head_dim(self) -> int:
        """Values per KV head and token in the cache (MLA: the latent and rope key)."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def max_window(self) -> int:
        """The widest attention window over the layers; 0 when any layer is global (then
        no block of a request ever falls outside every layer's window)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return 0
        return max(self.layer_windows)

    def max_model_len(self, requested: int | None) -> int:
        """The longest prompt + output to serve: ``requested`` (``ValueError`` above the
        model's position limit) or that limit. Windowed layers attend over their window
        (real sliding-window attention), so a window does not cap the length."""
        limit = self.max_position_embeddings
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
        return requested
