"""``DecodeService``: the engine as KV consumer, streaming tokens (docs/design.md §1 steps 5–7).

``Decode`` takes the prompt, the tokens already generated (the first token from prefill, or
everything so far when the router resumes a stream after losing a decode instance), the
sampling parameters and — in disaggregated mode — the prefill's ``KvHandle``. With a handle
the engine loads the prompt's KV from the store (a missing or corrupt block is recomputed
or fails the request, per ``--kv-load-failure``); without one it computes the prompt itself
(colocated mode). ``params.max_tokens`` is the request's total: the tokens handed in count
toward it, so a resumed request stops exactly where the original would have.

Each engine delta becomes one ``DecodeChunk``; timings ride on the first and the last chunk.

It lives here, below both services, because the prefill service registers it too: with no
healthy decode instance the router has a prefill instance serve whole requests
(docs/design.md §5, "Degrade, never drop").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc.aio

from common.grpc_tls import peer_identity
from engine.client import GenerateRequest
from engine.lora.request import SLOT_TIMEOUT_ERROR
from engine.sampling.guided import GUIDE_REFUSED
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from service.convert import (
    check_handle_compatible,
    logprobs_to_proto,
    phase_timings,
    remote_kv_from_handle,
    sampling_params_from_proto,
    token_ids,
)
from service.core import (
    EngineServiceCore,
    lora_identity,
)
from service.errors import IncompatibleKvHandle, LoRASlotBusy, ServiceUnavailable
from service.shared_rpcs import SharedRpcs
from service.spans import traced_decode


class DecodeServicer(SharedRpcs, pb_grpc.DecodeServiceServicer):
    """gRPC handlers over an ``EngineServiceCore``."""

    def __init__(self, core: EngineServiceCore) -> None:
        self._core = core

    def _prepare(self, request: pb.DecodeRequest) -> tuple[str, list[int], list[int], Any, Any]:
        """Validate a request → (request id, prompt, generated, sampling params, remote KV)."""
        core = self._core
        prompt = token_ids("prompt_token_ids", request.prompt_token_ids)
        generated = token_ids("generated_token_ids", request.generated_token_ids, allow_empty=True)
        params = sampling_params_from_proto(request.params)
        remote_kv = None
        if request.HasField("kv_handle"):
            handle = request.kv_handle
            check_handle_compatible(handle, core.engine)
            mine = lora_identity(core.engine, request.lora_name)
            if handle.lora_identity != mine:
                # KV of another adapter (or another version of it) would be silently wrong.
                raise IncompatibleKvHandle(
                    f"kv_handle was computed with LoRA adapter {handle.lora_identity or 'none'!r}"
                    f", this request runs {mine or 'none'!r} here"
                )
            remote_kv = remote_kv_from_handle(handle, len(prompt), core.engine)
        request_id = core.new_request_id(request.request_id)
        return request_id, prompt, generated, params, remote_kv

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        chunks = self._decode(request, context)
        if self._core.tracing is not None:  # its spans, from the chunks (service/spans.py)
            chunks = traced_decode(self._core.tracing, request, context, chunks)
        async with contextlib.aclosing(chunks) as stream:
            async for chunk in stream:
                yield chunk

    async def _decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.DecodeChunk, None]:
        core = self._core
        core.admit()
        request_id, prompt, generated, params, remote_kv = self._prepare(request)
        start = time.monotonic()
        first = True
        # Closed on every exit, errors raised below included (EngineServiceCore.run says why).
        async with contextlib.aclosing(
            core.run(
                GenerateRequest(
                    request_id,
                    prompt,
                    params,
                    output_token_ids=generated or None,
                    remote_kv=remote_kv,
                    priority=request.priority,
                    lora_name=request.lora_name or None,
                ),
                owner=peer_identity(context),  # the only identity that may Abort it
            )
        ) as stream:
            async for out in stream:
                if out.error and out.error.startswith(GUIDE_REFUSED):
                    raise ValueError(out.error)  # INVALID_ARGUMENT: the guide is over budget
                if out.error == SLOT_TIMEOUT_ERROR:
                    raise LoRASlotBusy(f"request {request_id}: {out.error}")
                if out.error:
                    # --kv-load-failure fail: the prompt's KV could not be loaded.
                    raise ServiceUnavailable(f"request {request_id}: {out.error}")
                chunk = pb.DecodeChunk(
                    token_ids=out.new_token_ids,
                    text=out.new_text,
                    logprobs=logprobs_to_proto(out.logprobs),
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    prompt_logprobs=logprobs_to_proto(out.prompt_logprobs),
                )
                if first or out.finished:
                    elapsed = time.monotonic() - start
                    timings = phase_timings(
                        out, compute_s=elapsed - out.queue_seconds - out.kv_load_seconds
                    )
                    chunk.timings.CopyFrom(timings)
                first = False
                if out.finished:
                    core.metrics.observe_timings(chunk.timings)
                yield chunk
