"""Tiny random models of the non-Llama architectures (Phi-3, Gemma 2/3, Mixtral,
Qwen3-MoE) and a windowed Mistral, saved with transformers in float32 with SmolLM2's
tokenizer (``tests/model_fixtures.save_tiny_model``). Windows are 16 tokens, so every
test prompt longer than that attends through a real sliding window; soft-caps are small
enough that tanh is far from linear on these weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.model_fixtures import _TINY_SHAPE, save_tiny_model

WINDOW = 16
ARCHS = ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "mistral_window")
# Phi-3's longrope switches to the long factors at this position (tests cross it).
PHI3_ORIGINAL_MAX = 128


def _spec(arch: str) -> tuple[Any, Any, dict[str, Any]]:
    import transformers as tf

    half = _TINY_SHAPE["head_dim"] // 2
    if arch == "phi3":
        rope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "rope_theta": 10000.0,
        }
        extra = {
            "rope_parameters": rope,
            "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
            "sliding_window": None,
        }
        return tf.Phi3Config, tf.Phi3ForCausalLM, extra
    gemma = {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    }
    if arch == "gemma2":
        extra = gemma | {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}
        return tf.Gemma2Config, tf.Gemma2ForCausalLM, extra
    if arch == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
        extra = gemma | {
            "rope_parameters": rope,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_hidden_layers": 3,
        }
        return tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, extra
    if arch == "mixtral":
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
        return tf.MixtralConfig, tf.MixtralForCausalLM, extra
    if arch == "qwen3_moe":
        extra = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        }
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, extra
    if arch == "mistral_window":
        return tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHS}")


def make_tiny_arch(arch: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random model of ``arch`` (one of ARCHS) saved into ``out_dir``."""
    config_cls, model_cls, extra = _spec(arch)
    return save_tiny_model(config_cls, model_cls, out_dir, seed, _TINY_SHAPE | extra | overrides)
