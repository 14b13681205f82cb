"""OpenAI response bodies and SSE framing for completions and chat completions.

Plain dicts serialised with ``json.dumps``: the hot path builds one small chunk per token,
so no pydantic here. Shapes follow the OpenAI API (what the ``openai`` client parses).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.errors import APIError
from router.legs.trace import Delta, TokenLogprob
from router.openai.best_of import best_indices
from router.tokenizer import PromptProcessor
from router.tools.parsers import ToolParser
from router.tools.parsers.stream import ToolCallStream, final_message

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
    tools: ToolCallStream | None = None  # chat with a tool-call parser


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float | str] | None = None
    route: dict[str, Any] | None = None  # the request's placement and routing (trace)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.timings is not None:
            out["pdserve_timings"] = self.timings
        if self.route is not None:
            out["pdserve_route"] = self.route
        return out


class AnswerFormat(Protocol):
    """What the handlers need from an answer's shape: this module's :class:`Formatter`
    (completions, chat) or router/openai/responses_format.py's (the Responses API)."""

    request_id: str
    include_usage_field: bool  # the stream ends with a usage event
    continuous_usage: bool
    done: bytes  # the stream's last bytes (b"" for none)

    def absorb(self, delta: Delta) -> tuple[ChoiceState, str]: ...
    def chunk(self, delta: Delta, usage: Usage | None = None) -> bytes: ...
    def usage_chunk(self, usage: Usage) -> bytes: ...
    def error_event(self, exc: APIError) -> bytes: ...
    def final(self, usage: Usage) -> dict[str, Any]: ...


class Formatter:
    """Builds the bodies of one request (``chat`` or completions)."""

    done = DONE

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        processor: PromptProcessor,
        num_choices: int,
        include_usage_field: bool = False,
        continuous_usage: bool = False,
        echo_text: list[str] | None = None,
        echo_ids: list[list[int]] | None = None,
        n: int = 1,
        keep: int | None = None,
        client_logprobs: bool = True,
        tool_parser: ToolParser | None = None,
    ) -> None:
        """``n``: choices generated per prompt; ``keep``: how many of them the answer has
        (best_of, router/openai/best_of.py; None = all); ``client_logprobs``: whether the answer
        shows logprobs (best_of generates them for ranking alone)."""
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.processor = processor
        self.choices = [ChoiceState() for _ in range(num_choices)]
        self.include_usage_field = include_usage_field
        self.continuous_usage = continuous_usage
        self.echo_text = echo_text
        # echo + logprobs: each prompt's ids and, once a delta brings them, its prompt
        # logprobs (the prefill's in P/D, shared by the prompt's choices).
        self.echo_ids = echo_ids
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self.n = n
        self.keep = keep
        self.client_logprobs = client_logprobs
        self.tool_parser = tool_parser
        if tool_parser is not None:
            for state in self.choices:
                state.tools = ToolCallStream(tool_parser)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def absorb(self, delta: Delta) -> tuple[ChoiceState, str]:
        """Update choice state; returns it and the text to emit (echo prepended once)."""
        state = self.choices[delta.index]
        text = delta.text
        if delta.prompt_logprobs:
            self.prompt_logprobs.setdefault(delta.index // self.n, delta.prompt_logprobs)
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
    def chunk(self, delta: Delta, usage: Usage | None = None) -> bytes:
        """The SSE event of one delta (b"" when a tool-call parser holds all of it back);
        ``usage``: the usage so far, for ``continuous_usage_stats``."""
        first = not (self.choices[delta.index].token_ids or self.choices[delta.index].text)
        state, text = self.absorb(delta)
        items: list[TokenLogprob | int] = list(delta.logprobs or [])
        if first and delta.logprobs is not None:
            items = self._echo_items(delta.index) + items
        logprobs = self._logprobs(state, items) if items else None
        if self.chat:
            finish = delta.finish_reason
            body_delta: dict[str, Any] = {"content": text}
            if state.tools is not None:
                content, calls = state.tools.feed(text, finish is not None)
                body_delta = {"content": content} if content else {}
                if calls:
                    body_delta["tool_calls"] = calls
                if finish == "stop" and state.tools.called:
                    finish = "tool_calls"
                if not (body_delta or finish or logprobs or not state.started):
                    return b""
            if not state.started:
                state.started = True
                body_delta = {"role": "assistant", "content": ""} | body_delta
            choice: dict[str, Any] = {
                "index": delta.index,
                "delta": body_delta,
                "logprobs": logprobs,
                "finish_reason": finish,
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
            payload["usage"] = usage.body() if usage is not None else None
        return sse(payload)

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload = self._head(obj)
        payload["choices"] = []
        payload["usage"] = usage.body()
        return sse(payload)

    def error_event(self, exc: APIError) -> bytes:
        """An error after the first byte, in band (the stream has answered 200)."""
        return sse(exc.body())

    # -- whole answer ----------------------------------------------------------------------
    def final(self, usage: Usage) -> dict[str, Any]:
        choices = []
        kept = list(range(len(self.choices)))
        if self.keep is not None:
            kept = best_indices([s.logprobs for s in self.choices], self.n, self.keep)
        for index, i in enumerate(kept):
            state = self.choices[i]
            logprobs = None
            if state.logprobs and self.client_logprobs:
                items = self._echo_items(i) + list(state.logprobs)
                logprobs = self._logprobs(ChoiceState(), items)
            finish = state.finish_reason or "stop"
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": state.text}
                if self.tool_parser is not None:
                    message = final_message(self.tool_parser, state.text)
                    if finish == "stop" and message.get("tool_calls"):
                        finish = "tool_calls"
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": state.text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }
                )
        payload = self._head("chat.completion" if self.chat else "text_completion")
        payload["choices"] = choices
        payload["usage"] = usage.body()
        return payload

    def _echo_items(self, index: int) -> list[TokenLogprob | int]:
        """Completions with echo + logprobs: the prompt's tokens ahead of choice ``index``'s
        own (the first one, which nothing predicts, as a bare id: a null logprob)."""
        if self.echo_ids is None:
            return []
        ids = self.echo_ids[index // self.n]
        lps = self.prompt_logprobs.get(index // self.n)
        if lps is None or len(lps) != len(ids) - 1:
            return []
        return [ids[0], *lps]

    def _logprobs(self, state: ChoiceState, items: list[TokenLogprob | int]) -> dict[str, Any]:
        tok = self.processor.token_text
        if self.chat:
            content = []
            for item in items:
                assert not isinstance(item, int)  # chat has no echo
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
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for item in items:
            if isinstance(item, int):  # the echoed prompt's first token
                tokens.append(tok(item))
                token_logprobs.append(None)
                top.append(None)
                offsets.append(state.text_offset)
                state.text_offset += len(tokens[-1])
                continue
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
