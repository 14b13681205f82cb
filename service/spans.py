"""A service call's spans, from what the call already sends (docs/design.md §3 "Tracing").

The engine does no tracing work: its outputs carry the timings (queue, compute, KV save
and load seconds, blocks) that the services put on their events anyway. These wrappers
read those events as they pass, and when the call ends emit its spans after the fact
under the caller's trace context (the ``traceparent`` of the call's metadata):

- ``Prefill``: ``prefill.request`` (SERVER) → ``prefill.queue``, ``prefill.compute``,
  then ``kv.save`` (a store connector) or ``kv.publish`` (p2p: the blocks are held here
  for the decode side to pull);
- ``Decode``: ``decode.request`` (SERVER) → ``decode.queue``, ``kv.load`` (with a KV
  handle), ``decode.first_token`` (computing up to the first token), ``decode.generate``.

Used only when tracing is on (``EngineServiceCore.tracing``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from common.tracing import Tracing
from pdserve_api.v1 import pdserve_pb2 as pb


@dataclass(slots=True)
class _Call:
    """The wall and monotonic clocks at the call's start, and what its events told."""

    tracing: Tracing
    server: Any  # the SERVER span, open until the call ends
    start_mono: float = field(default_factory=time.monotonic)
    start_ns: int = field(default_factory=time.time_ns)

    def at(self, mono: float) -> int:
        """Epoch ns of a ``time.monotonic()`` reading of this call."""
        return self.start_ns + int((mono - self.start_mono) * 1e9)

    def child(self, name: str, start: float, end: float, **attrs: Any) -> None:
        """A span from ``start`` to ``end`` seconds after the call began."""
        self.tracing.record(
            name,
            self.server,
            self.at(self.start_mono + start),
            self.at(self.start_mono + max(start, end)),
            attrs,
        )

    def close(self, error: BaseException | None, **attrs: Any) -> None:
        for key, value in attrs.items():
            if value is not None:
                self.server.set_attribute(key, value)
        text = None if error is None else f"{type(error).__name__}: {error}"
        self.tracing.end(self.server, error=text)


def _open(tracing: Tracing, context: Any, name: str, request: Any, **attrs: Any) -> _Call:
    parent = tracing.extract(context.invocation_metadata() or ())
    attributes = {
        "rpc.system": "grpc",
        "pdserve.request_id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        **attrs,
    }
    return _Call(tracing, tracing.start(name, parent, kind="server", attributes=attributes))


async def traced_prefill(
    tracing: Tracing, request: pb.PrefillRequest, context: Any, events: AsyncIterator[Any]
) -> AsyncGenerator[Any, None]:
    """``events`` of one Prefill call, unchanged; its spans when it ends."""
    call = _open(tracing, context, "prefill.request", request)
    error: BaseException | None = None
    cached = None
    try:
        async for event in events:
            now = time.monotonic() - call.start_mono
            t = event.timings
            if event.HasField("first_token"):
                cached = event.first_token.num_cached_tokens
                call.child("prefill.queue", 0.0, t.queue_s)
                call.child(
                    "prefill.compute",
                    t.queue_s,
                    t.queue_s + t.compute_s,
                    **{"pdserve.cached_tokens": cached},
                )
            if event.HasField("kv_committed"):
                _save_span(call, event.kv_committed, now, t.kv_save_s)
            yield event
    except BaseException as exc:
        error = exc
        raise
    finally:
        call.close(error, **{"pdserve.cached_tokens": cached})


def _save_span(call: _Call, handle: pb.KvHandle, now: float, seconds: float) -> None:
    held = bool(handle.source_address)
    call.child(
        "kv.publish" if held else "kv.save",
        now - seconds,
        now,
        **{
            "pdserve.kv.connector": handle.connector,
            "pdserve.kv.blocks": len(handle.block_keys),
            "pdserve.kv.tokens": handle.num_tokens,
            "pdserve.kv.transfer_id": handle.transfer_id or None,
        },
    )


async def traced_decode(
    tracing: Tracing, request: pb.DecodeRequest, context: Any, chunks: AsyncIterator[Any]
) -> AsyncGenerator[Any, None]:
    """``chunks`` of one Decode call, unchanged; its spans when it ends."""
    has_handle = request.HasField("kv_handle")
    call = _open(
        tracing,
        context,
        "decode.request",
        request,
        **{
            "pdserve.resumed_tokens": len(request.generated_token_ids),
            "pdserve.kv.connector": request.kv_handle.connector if has_handle else None,
        },
    )
    error: BaseException | None = None
    first_at: float | None = None
    tokens = 0
    finish = None
    try:
        async for chunk in chunks:
            now = time.monotonic() - call.start_mono
            tokens += len(chunk.token_ids)
            if first_at is None:
                first_at = now
                _first_chunk_spans(call, chunk.timings, now, has_handle)
            if chunk.finished:
                finish = chunk.finish_reason or "stop"
            yield chunk
    except BaseException as exc:
        error = exc
        raise
    finally:
        if first_at is not None:
            end = time.monotonic() - call.start_mono
            call.child("decode.generate", first_at, end, **{"gen_ai.usage.output_tokens": tokens})
        call.close(
            error,
            **{
                "gen_ai.usage.output_tokens": tokens,
                "gen_ai.response.finish_reasons": [finish] if finish else None,
            },
        )


def _first_chunk_spans(call: _Call, t: Any, now: float, has_handle: bool) -> None:
    """Queue wait, KV load, and the compute up to the first token (the first chunk's
    timings; they are measured in the engine, the clock here is this call's)."""
    call.child("decode.queue", 0.0, t.queue_s)
    load_end = t.queue_s + t.kv_load_s
    if has_handle:
        call.child(
            "kv.load",
            t.queue_s,
            load_end,
            **{
                "pdserve.kv.blocks_loaded": t.kv_blocks_loaded,
                "pdserve.kv.blocks_recomputed": t.kv_blocks_recomputed,
            },
        )
    call.child("decode.first_token", load_end, max(load_end, now))
