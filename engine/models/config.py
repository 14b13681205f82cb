"""Architecture parameters read from a Hugging Face config.json (Llama family)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = str(archs[0]) if isinstance(archs, list) and archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {arch or '(none)'!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def max_model_len(self, requested: int | None) -> int:
        """The longest prompt + output to serve: ``requested`` (``ValueError`` above the
        model's limit) or the limit. Without sliding-window attention the limit stays where
        full attention is exact: the position limit, capped at a sliding window."""
        limit = self.max_position_embeddings
        if self.sliding_window:
            limit = min(limit, self.sliding_window)
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's limit {limit}")
        return requested
