"""Prompt workloads for `pdserve bench serve`: seeded, sized in tokens of a given tokenizer.

Kinds:
- `random`: random-token prompts; input and output lengths fixed (`128`) or uniform in an
  inclusive range (`64:256`).
- `sharegpt`: a synthetic ShareGPT-like mix: lognormal input and output lengths whose
  medians are the given (fixed) lengths, clipped to [4, 8 x median] and [1, 4 x median].
- `prefix`: `num_prefixes` groups; every prompt is its group's shared random prefix of
  `prefix_len` tokens, a newline, then a unique random suffix of `input_len` tokens (to
  study prefix caching and prefix-aware routing).
- `chat`: multi-turn conversations over `num_prefixes` shared system prompts of
  `prefix_len` tokens, `num_turns` turns each, every turn's prompt the previous one plus
  an answer and a new user message of `input_len` tokens (`pdserve/bench/workloads_chat.py`).
- `jsonl`: one JSON object per line, `{"prompt": str, "max_tokens": int (optional)}`.
Lengths are measured with the tokenizer (re-encoding decoded text can merge tokens, so a
prompt's `prompt_len` is what the tokenizer counts for its final text).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.workload_spec import (
    KINDS,
    LengthRange,
    Prompt,
    TextCodec,
    WorkloadSpec,
    random_text,
)
from pdserve.bench.workloads_chat import chat_prompts

# Re-exported: the spec and the pieces every workload is made of.
__all__ = [
    "KINDS",
    "HFCodec",
    "LengthRange",
    "Prompt",
    "TextCodec",
    "WordCodec",
    "WorkloadSpec",
    "build_prompts",
    "load_codec",
    "random_text",
]

# Without a tokenizer, prompts are made of these words, one "token" each.
# fmt: off
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
    "at", "from", "his", "her", "an", "be", "this", "are", "which", "have", "or", "had", "not",
    "but", "were", "they", "one", "all", "their", "has", "been", "more", "when", "there",
    "who", "also", "its", "time", "into", "after", "first", "new", "two", "other", "some",
    "would", "may", "than", "only", "over", "years", "world", "city", "river", "stone", "light",
    "water", "music", "garden", "paper", "window", "market", "school", "story", "number",
    "system",
)
# fmt: on


class HFCodec:
    """A Hugging Face tokenizer. Prompts are sampled only from ids that decode on their own
    to clean text: no special tokens, no partial UTF-8 bytes (which would come back as
    U+FFFD and re-encode to several tokens)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        self._pool = [i for i, t in zip(ids, texts, strict=True) if t.strip() and "\ufffd" not in t]
        if not self._pool:
            raise ValueError("tokenizer has no plain-text tokens to build prompts from")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def sample_pool(self) -> list[int]:
        return self._pool


class WordCodec:
    """Tokenizer-free fallback: whitespace-separated words, one token each."""

    def __init__(self) -> None:
        self._index = {w: i for i, w in enumerate(_WORDS)}

    def encode(self, text: str) -> list[int]:
        return [self._index.get(w, 0) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids)

    def sample_pool(self) -> list[int]:
        return list(range(len(_WORDS)))


def load_codec(tokenizer_dir: str | None) -> TextCodec:
    """A codec for a local Hugging Face tokenizer directory, or the word fallback."""
    if tokenizer_dir is None:
        return WordCodec()
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(f"--tokenizer {tokenizer_dir!r} is not a directory")
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is asked for

    return HFCodec(AutoTokenizer.from_pretrained(tokenizer_dir))


def build_prompts(spec: WorkloadSpec, codec: TextCodec) -> list[Prompt]:
    """The workload's prompts, `spec.num_prompts` of them (a JSONL file is cycled)."""
    spec.validate()
    rng = random.Random(spec.seed)
    if spec.kind == "jsonl":
        assert spec.path is not None  # validate() checked
        return _jsonl_prompts(Path(spec.path), spec, codec, rng)
    out_range = LengthRange.parse(spec.output_len, "output length")
    in_range = LengthRange.parse(spec.input_len, "input length")
    if spec.kind == "sharegpt":
        return _sharegpt_prompts(spec, codec, rng, in_range, out_range)
    if spec.kind == "prefix":
        return _prefix_prompts(spec, codec, rng, in_range, out_range)
    if spec.kind == "chat":
        return chat_prompts(spec, codec, rng, in_range, out_range)
    prompts = []
    for _ in range(spec.num_prompts):
        text, n = random_text(codec, in_range.sample(rng), rng)
        prompts.append(Prompt(text, n, out_range.sample(rng)))
    return prompts


def _lognormal_len(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    value = int(round(median * math.exp(rng.gauss(0.0, sigma))))
    return max(low, min(high, value))


def _sharegpt_prompts(
    spec: WorkloadSpec,
    codec: TextCodec,
    rng: random.Random,
    in_range: LengthRange,
    out_range: LengthRange,
) -> list[Prompt]:
    if in_range.low != in_range.high or out_range.low != out_range.high:
        raise ValueError("sharegpt workload takes fixed lengths (the medians), not ranges")
    med_in, med_out = in_range.low, out_range.low
    prompts = []
    for _ in range(spec.num_prompts):
        n_in = _lognormal_len(rng, med_in, 1.0, min(4, med_in), 8 * med_in)
        n_out = _lognormal_len(rng, med_out, 0.8, 1, 4 * med_out)
        text, n = random_text(codec, n_in, rng)
        prompts.append(Prompt(text, n, n_out))
    return prompts


def _prefix_prompts(
    spec: WorkloadSpec,
    codec: TextCodec,
    rng: random.Random,
    in_range: LengthRange,
    out_range: LengthRange,
) -> list[Prompt]:
    prefixes = [random_text(codec, spec.prefix_len, rng)[0] for _ in range(spec.num_prefixes)]
    groups = [i % spec.num_prefixes for i in range(spec.num_prompts)]
    rng.shuffle(groups)
    prompts = []
    for group in groups:
        suffix, _ = random_text(codec, in_range.sample(rng), rng)
        # The newline keeps the prefix's tokens intact: pre-tokenizers split at it.
        text = f"{prefixes[group]}\n{suffix}"
        prompts.append(Prompt(text, len(codec.encode(text)), out_range.sample(rng), group))
    return prompts


def _jsonl_prompts(
    path: Path, spec: WorkloadSpec, codec: TextCodec, rng: random.Random
) -> list[Prompt]:
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    out_range = LengthRange.parse(spec.output_len, "output length")
    rows: list[Prompt] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rows.append(_jsonl_row(line, f"{path}:{lineno}", codec, out_range, rng))
    if not rows:
        raise ValueError(f"dataset file {str(path)!r} has no prompts")
    return [rows[i % len(rows)] for i in range(spec.num_prompts)]


def _jsonl_row(
    line: str, where: str, codec: TextCodec, out_range: LengthRange, rng: random.Random
) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f'{where}: expected an object with a non-empty "prompt" string')
    max_tokens = obj.get("max_tokens", None)
    if max_tokens is None:
        max_tokens = out_range.sample(rng)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f'{where}: "max_tokens" must be an integer >= 1')
    return Prompt(prompt, len(codec.encode(prompt)), max_tokens)
