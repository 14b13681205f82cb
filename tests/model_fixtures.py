"""Model fixtures for tests: the real SmolLM2 directory and tiny random models.

Use from a test module or conftest with ``pytest_plugins = ["tests.model_fixtures"]`` (root
conftest) or by importing the fixtures. Builders are plain functions so tests can make
variants: ``make_tiny_llama(dir, tie_word_embeddings=True)``, ``make_tiny("qwen3", dir)``.

Tiny models use SmolLM2's tokenizer (vocab 49152, ChatML template, bos 1, eos 2) so text
prompts and chat templates work on them; they are saved in float32 from a fixed seed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.models import pull_model

SMOLLM2_VOCAB = 49152
BOS_ID, EOS_ID = 1, 2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "llama3_rope_scaling")

# Shape shared by every tiny variant: 2 layers, hidden 64, 4 heads over 2 KV heads.
_TINY_SHAPE: dict[str, Any] = {
    "vocab_size": SMOLLM2_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": EOS_ID,
}


def smollm2_path() -> Path:
    """The pulled SmolLM2 directory (pulled into the user cache on first use, ~30 s)."""
    return pull_model("smollm2").path


def tokenizer_source() -> Path:
    """Where the tiny models' tokenizer files come from: ``PDSERVE_TEST_TOKENIZER_DIR`` when
    set (a GPU machine without the model package: its few MB of tokenizer files travel
    instead, benchmarks/README.md "GPU runs still to make"), else the pulled SmolLM2."""
    carried = os.environ.get("PDSERVE_TEST_TOKENIZER_DIR")
    return Path(carried) if carried else smollm2_path()


def copy_tokenizer(out_dir: Path, source_dir: Path | None = None) -> None:
    """Copy the tokenizer files (default: SmolLM2's) into ``out_dir``."""
    source = source_dir if source_dir is not None else tokenizer_source()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)


def argmax_continuations(model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuation with a transformers model's own forward and KV cache. A plain
    argmax loop rather than ``generate``: ``generate`` applies EOS handling of its own, and
    our reference for ``ignore_eos`` is "the argmax, whatever token it is"."""
    import torch

    outs = []
    with torch.inference_mode():
        for ids in prompts:
            result = model(torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            for _ in range(max_new):
                tokens.append(int(result.logits[0, -1].argmax()))
                result = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=result.past_key_values,
                    use_cache=True,
                )
            outs.append(tokens)
    return outs


def _perturb_trivial_params(model: Any, seed: int) -> None:
    """transformers initialises norm weights to 1 and biases to 0; an implementation that
    ignored them would still match. Give them seeded random values so parity tests see them."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=gen) * 0.1)
            elif name.endswith(".sinks"):  # gpt-oss: a real share of each softmax
                param.copy_(torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def save_tiny_model(
    config_cls: Any, model_cls: Any, out_dir: str | Path, seed: int, params: dict[str, Any]
) -> Path:
    """Build ``model_cls(config_cls(**params))`` from ``seed`` in float32 and save it with a
    generation config and the SmolLM2 tokenizer into ``out_dir``; return ``out_dir``."""
    import torch
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config_cls(**params)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _perturb_trivial_params(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(out))
    copy_tokenizer(out)
    return out


def make_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads, 2 KV heads,
    intermediate 128, vocab 49152) in ``out_dir``; ``overrides`` are LlamaConfig fields,
    e.g. ``tie_word_embeddings=True`` or ``attention_bias=True``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_tiny_model(LlamaConfig, LlamaForCausalLM, out_dir, seed, _TINY_SHAPE | overrides)


def _arch_spec(arch: str) -> tuple[Any, Any, dict[str, Any]]:
    """(config class, model class, overrides) of one named tiny architecture."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig, tf.LlamaForCausalLM, {}
    if arch == "llama3_rope_scaling":
        # original_max_position_embeddings well below the prompt lengths tests use, so the
        # scaled low frequencies actually change the rotary angles.
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return (
            tf.LlamaConfig,
            tf.LlamaForCausalLM,
            {"rope_theta": 500000.0, "rope_scaling": scaling},
        )
    if arch == "qwen2":
        # Qwen2 always has q/k/v biases; small Qwen2.5 checkpoints tie their embeddings.
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, {"tie_word_embeddings": True}
    if arch == "qwen3":
        # head_dim deliberately != hidden / heads, as in real Qwen3 checkpoints.
        return tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}
    if arch == "mistral":
        return tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of: {', '.join(TINY_ARCHS)}")


def make_tiny(arch: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random model of ``arch`` (one of TINY_ARCHS) saved into ``out_dir``."""
    config_cls, model_cls, arch_overrides = _arch_spec(arch)
    params = _TINY_SHAPE | arch_overrides | overrides
    return save_tiny_model(config_cls, model_cls, out_dir, seed, params)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct directory in the user cache (reused across runs)."""
    return smollm2_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, built once per session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``factory(arch) -> dir``: each tiny architecture built at most once per session."""
    built: dict[str, Path] = {}

    def factory(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return built[arch]

    return factory
