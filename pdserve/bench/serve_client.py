"""One streaming OpenAI-style request, timed: the client half of `pdserve bench serve`.

`send_request` never raises for server or network trouble: every failure becomes a
`RequestRecord` with `ok=False` and an error kind, so a dead or hung server produces errors
(bounded by the per-request timeout), not a hang or a crash.

Error kinds: `connect` (refused/unreachable), `timeout` (no completion within the
request timeout), `http_<status>` (non-200 answer), `disconnect` (connection dropped
mid-stream), `stream_error` (an error object inside the stream), `bad_stream` (an
unparseable event), `incomplete` (stream ended without `[DONE]`), `no_output` (no tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import Prompt, TextCodec

log = logging.getLogger(__name__)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    model: str
    endpoint: str = "completions"
    timeout_s: float = 300.0
    request_timings: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    # A mixed-adapter workload (docs/lora.md): each prompt goes to one of ``model`` and
    # these LoRA adapter names, picked from the prompt's text (the same prompt, the same
    # model, run after run).
    lora_models: tuple[str, ...] = ()

    def model_for(self, prompt: Prompt) -> str:
        if not self.lora_models:
            return self.model
        names = (self.model, *self.lora_models)
        return names[zlib.crc32(prompt.text.encode()) % len(names)]

    def validate(self) -> None:
        """Raise ValueError on a bad endpoint, URL or timeout."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose one of {list(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be > 0, got {self.timeout_s}")

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        path = ENDPOINTS[self.endpoint]
        # Accept both http://host:port and http://host:port/v1 as the base.
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        return base + path


def build_body(target: Target, prompt: Prompt) -> dict[str, Any]:
    """The JSON body for one streamed request; `ignore_eos` keeps output lengths fixed."""
    body: dict[str, Any] = {
        "model": target.model_for(prompt),
        "max_tokens": prompt.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": target.temperature,
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if target.request_timings:
        body["pdserve_timings"] = True
    body.update(target.extra_body)
    return body


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        return str(obj["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


def _chunk_text(obj: dict[str, Any], endpoint: str) -> str:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return str(delta.get("content") or "")
    return str(choices[0].get("text") or "")


@dataclass(slots=True)
class _StreamState:
    text_parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False


async def _consume(
    resp: httpx.Response, rec: RequestRecord, endpoint: str, start: float
) -> _StreamState:
    state = _StreamState()
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: lines
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            state.done = True
            break
        try:
            obj = json.loads(payload)
        except ValueError:
            rec.error, rec.error_detail = "bad_stream", payload[:200]
            return state
        if "error" in obj:
            rec.error, rec.error_detail = "stream_error", str(obj["error"])[:200]
            return state
        text = _chunk_text(obj, endpoint)
        if text:
            rec.chunk_times.append(time.perf_counter() - start)
            state.text_parts.append(text)
        if isinstance(obj.get("usage"), dict):
            state.usage = obj["usage"]
    return state


def _finish(rec: RequestRecord, state: _StreamState, codec: TextCodec | None) -> None:
    usage = state.usage or {}
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]  # the server's count includes templates
    timings = usage.get("pdserve_timings")
    if isinstance(timings, dict):
        rec.timings = {str(k): float(v) for k, v in timings.items() if isinstance(v, int | float)}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
    elif codec is not None:
        rec.output_tokens = len(codec.encode("".join(state.text_parts)))
    else:
        rec.output_tokens = len(rec.chunk_times)
    if rec.error is not None:
        return
    if not state.done:
        rec.error = "incomplete"
    elif not rec.chunk_times:
        rec.error = "no_output"
    else:
        rec.ok = True


async def _stream_one(
    client: httpx.AsyncClient,
    target: Target,
    prompt: Prompt,
    codec: TextCodec | None,
    rec: RequestRecord,
) -> None:
    async with client.stream("POST", target.url, json=build_body(target, prompt)) as resp:
        if resp.status_code != 200:
            rec.error = f"http_{resp.status_code}"
            rec.error_detail = _error_message(await resp.aread())
            return
        _finish(rec, await _consume(resp, rec, target.endpoint, rec.start), codec)


async def send_request(
    client: httpx.AsyncClient, target: Target, prompt: Prompt, codec: TextCodec | None = None
) -> RequestRecord:
    """Send one streamed request and time it; every failure is returned as a record."""
    rec = RequestRecord(prompt_tokens=prompt.prompt_len, start=time.perf_counter())
    try:
        await asyncio.wait_for(_stream_one(client, target, prompt, codec, rec), target.timeout_s)
    except asyncio.TimeoutError:
        rec.error, rec.error_detail = "timeout", f"no completion within {target.timeout_s}s"
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        rec.error, rec.error_detail = "connect", str(exc) or type(exc).__name__
    except httpx.TimeoutException as exc:
        rec.error, rec.error_detail = "timeout", str(exc) or type(exc).__name__
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        rec.error, rec.error_detail = "disconnect", str(exc) or type(exc).__name__
    except httpx.HTTPError as exc:
        rec.error, rec.error_detail = "http_error", str(exc) or type(exc).__name__
    rec.e2e = time.perf_counter() - rec.start
    if rec.error:
        rec.ok = False
        log.debug("request failed: %s %s", rec.error, rec.error_detail)
    return rec
