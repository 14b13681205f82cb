"""Torch-free prompt processing for the router: tokenizer, chat template, block hashes.

`transformers` imports torch as soon as it is imported, and the router runs in small CPU
pods without it, so this reads a Hugging Face model directory with the `tokenizers` library
and renders the chat template with a sandboxed Jinja environment configured the way
Hugging Face renders chat templates (trim/lstrip blocks, ``raise_exception``, ``tojson``,
``strftime_now``). Token ids therefore match ``AutoTokenizer`` for the same directory.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.block_hash import compute_block_hashes

LONG_TEXT = 4096  # characters: longer texts are tokenized off the event loop

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "float8": 1,
    "float8_e4m3fn": 1,  # an fp8 KV cache (--kv-cache-dtype fp8): what its KvHandle says
}


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``) or is missing."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the router needs from ``config.json``: context length and KV bytes per token."""

    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 0  # 0 = unknown (no token-id range check)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """KV bytes one token occupies for ``dtype`` (K and V, every layer)."""
        size = _DTYPE_BYTES.get(dtype.lower().removeprefix("torch."), 2)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * size

    @classmethod
    def from_config(cls, config: dict[str, Any], max_model_len: int | None = None) -> ModelShape:
        heads = int(config.get("num_attention_heads", 1))
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", heads)) // heads)
        return cls(
            max_model_len=int(max_model_len or config.get("max_position_embeddings", 2048)),
            num_layers=int(config.get("num_hidden_layers", 1)),
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            vocab_size=int(config.get("vocab_size", 0)),
        )


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


class PromptProcessor:
    """Tokenize prompts and chats the way the engine's tokenizer does; hash their blocks.

    Thread-safe for concurrent ``encode`` calls (the Rust tokenizer releases the GIL).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        shape: ModelShape,
        block_size: int = 16,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._tok = tokenizer
        self.shape = shape
        self.block_size = block_size
        self.special_tokens = special_tokens
        eos = special_tokens.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None
        self._template = None
        # Names the template reads (e.g. whether it renders ``tools``; router/tools/template.py).
        self.template_variables: frozenset[str] = frozenset()
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)
            self.template_variables = frozenset(
                jinja2.meta.find_undeclared_variables(env.parse(chat_template))
            )

    @classmethod
    def from_model_dir(
        cls, path: str | Path, *, block_size: int = 16, max_model_len: int | None = None
    ) -> PromptProcessor:
        """Load ``tokenizer.json``, ``tokenizer_config.json``, the chat template and ``config.json``."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(
                f"{root} has no tokenizer.json: the router needs a fast (tokenizers) tokenizer"
            )
        tokenizer = Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(root / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        specials = {k: _token_text(v) for k, v in tok_config.items() if k.endswith("_token") and v}
        shape = ModelShape.from_config(_read_json(root / "config.json"), max_model_len)
        return cls(
            tokenizer,
            chat_template=template,
            special_tokens=specials,
            shape=shape,
            block_size=block_size,
        )

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Most characters one token can stand for (its vocabulary piece is at least as long
        as its text: one piece character per byte in byte-level BPE), so a text of ``n``
        characters is at least ``n / max_token_chars`` tokens without tokenizing it."""
        return max((len(piece) for piece in self._tok.get_vocab()), default=1) or 1

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``encode`` for a handler: a long text is tokenized on a worker thread, so it
        does not stall every other request on the event loop."""
        if len(text) > LONG_TEXT:
            return await asyncio.to_thread(self.encode, text, add_special_tokens=add_special_tokens)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as prompt text through the model's chat template (``tools``
        passed the way transformers does, for templates that render them;
        ``template_kwargs``: the request's ``chat_template_kwargs``, such as Qwen3's
        ``enable_thinking``, beneath the variables named here)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        variables = dict(template_kwargs or {})
        variables |= self.special_tokens
        variables |= {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            variables["tools"] = tools
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message and messages:
            # Cut what the template appended after the last message so the model continues it.
            final = str(messages[-1].get("content") or "")
            cut = text.rfind(final) if final else -1
            if cut >= 0:
                text = text[: cut + len(final)]
        return text

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        # The template already wrote any BOS it wants.
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (may be a partial UTF-8 character)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def block_hashes(self, token_ids: Sequence[int], root: bytes | None = None) -> list[bytes]:
        """Chained hashes of the prompt's full blocks (the engine's and the KV store's keys;
        ``root``: another chain root, router/lora.py)."""
        if root is None:
            return compute_block_hashes(token_ids, self.block_size)
        return compute_block_hashes(token_ids, self.block_size, root=root)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    # tokenizer_config stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)
