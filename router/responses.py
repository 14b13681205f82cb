"""OpenAI response bodies and SSE framing for completions and chat completions.

Plain dicts serialised with ``json.dumps``: the hot path builds one small chunk per token,
so no pydantic here. Shapes follow the OpenAI API (what the ``openai`` client parses).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from router.tokenizer import PromptProcessor
from router.trace import Delta, TokenLogprob

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


@dataclass(slots=True)
class ChoiceState:
    """Everything one choice produced so far (for non-streaming answers and logprobs)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # chat: the role delta was sent
    text_offset: int = 0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.timings is not None:
            out["pdserve_timings"] = self.timings
        return out


class Formatter:
    """Builds the bodies of one request (``chat`` or completions)."""

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        processor: PromptProcessor,
        num_choices: int,
        include_usage_field: bool = False,
        echo_text: list[str] | None = None,
        n: int = 1,
    ) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.processor = processor
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self.include_usage_field = include_usage_field
        self.echo_text = echo_text
        self.n = n

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def absorb(self, delta: Delta) -> tuple[ChoiceState, str]:
        """Update choice state; returns it and the text to emit (echo prepended once)."""
        state = self.choices[delta.index]
        text = delta.text
        if self.echo_text is not None and not state.token_ids and not state.text:
            text = self.echo_text[delta.index // self.n] + text
        state.text += text
        state.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            state.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            state.finish_reason = delta.finish_reason
        return state, text

    # -- streaming -------------------------------------------------------------------------
    def chunk(self, delta: Delta) -> bytes:
        state, text = self.absorb(delta)
        logprobs = self._logprobs(state, delta.logprobs) if delta.logprobs else None
        if self.chat:
            body_delta: dict[str, Any] = {"content": text}
            if not state.started:
                state.started = True
                body_delta = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {
                "index": delta.index,
                "delta": body_delta,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            payload = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": delta.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            payload = self._head("text_completion")
        payload["choices"] = [choice]
        if self.include_usage_field:
            payload["usage"] = None
        return sse(payload)

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload = self._head(obj)
        payload["choices"] = []
        payload["usage"] = usage.body()
        return sse(payload)

    # -- whole answer ----------------------------------------------------------------------
    def final(self, usage: Usage) -> dict[str, Any]:
        choices = []
        for index, state in enumerate(self.choices):
            logprobs = self._logprobs(ChoiceState(), state.logprobs) if state.logprobs else None
            if self.chat:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": state.text},
                        "logprobs": logprobs,
                        "finish_reason": state.finish_reason or "stop",
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": state.text,
                        "logprobs": logprobs,
                        "finish_reason": state.finish_reason or "stop",
                    }
                )
        payload = self._head("chat.completion" if self.chat else "text_completion")
        payload["choices"] = choices
        payload["usage"] = usage.body()
        return payload

    def _logprobs(self, state: ChoiceState, items: list[TokenLogprob]) -> dict[str, Any]:
        tok = self.processor.token_text
        if self.chat:
            content = []
            for item in items:
                text = tok(item.token_id)
                content.append(
                    {
                        "token": text,
                        "logprob": item.logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {"token": tok(t), "logprob": lp, "bytes": list(tok(t).encode())}
                            for t, lp in item.top
                        ],
                    }
                )
            return {"content": content}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for item in items:
            text = tok(item.token_id)
            tokens.append(text)
            token_logprobs.append(item.logprob)
            # With logprobs=0 there are no alternatives: report the chosen token alone.
            top.append({tok(t): lp for t, lp in item.top} if item.top else {text: item.logprob})
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
