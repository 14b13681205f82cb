"""``PrefillService``: the engine as KV producer (docs/design.md §1 steps 3–4).

``Prefill`` runs the prompt with ``max_tokens=1`` and ``save_kv=True``. Its stream carries
two events: ``first_token`` the moment the token is sampled (TTFT never waits for the KV
save), then ``kv_committed`` with the ``KvHandle`` once every prompt block the store lacked
is written. A store failure after the first token ends the stream with UNAVAILABLE and the
trailer ``pdserve-error: kv-save-failed``, so the router knows the handle never came and
that the instance is fine: decode computes the prompt itself.
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
    kv_handle,
    logprobs_to_proto,
    phase_timings,
    sampling_params_from_proto,
    token_ids,
)
from service.core import (
    EngineServiceCore,
    lora_identity,
)
from service.errors import KVSaveFailed, LoRASlotBusy
from service.shared_rpcs import SharedRpcs
from service.spans import traced_prefill


class PrefillServicer(SharedRpcs, pb_grpc.PrefillServiceServicer):
    """gRPC handlers over an ``EngineServiceCore``; ``connector_name`` goes into handles."""

    def __init__(self, core: EngineServiceCore, connector_name: str) -> None:
        self._core = core
        self._connector_name = connector_name

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        events = self._prefill(request, context)
        if self._core.tracing is not None:  # its spans, from the events (service/spans.py)
            events = traced_prefill(self._core.tracing, request, context, events)
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                yield event

    async def _prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.PrefillEvent, None]:
        core = self._core
        core.admit()
        request_id = core.new_request_id(request.request_id)
        prompt = token_ids("prompt_token_ids", request.prompt_token_ids)
        params = sampling_params_from_proto(request.params, max_tokens=1)
        start = time.monotonic()
        first_at: float | None = None
        last: Any = None
        committed = False
        new = GenerateRequest(
            request_id,
            prompt,
            params,
            save_kv=True,
            priority=request.priority,
            lora_name=request.lora_name or None,
        )
        # Closed on every exit, errors raised below included (EngineServiceCore.run says why).
        async with contextlib.aclosing(core.run(new, owner=peer_identity(context))) as outputs:
            async for out in outputs:
                last = out
                if out.error and out.error.startswith(GUIDE_REFUSED):
                    raise ValueError(out.error)  # INVALID_ARGUMENT: the guide is over budget
                if out.error == SLOT_TIMEOUT_ERROR:  # waited past its deadline for a LoRA slot
                    raise LoRASlotBusy(f"request {request_id}: {out.error}")
                if out.new_token_ids and first_at is None:
                    first_at = time.monotonic()
                    yield pb.PrefillEvent(
                        first_token=self._first_token(out),
                        timings=phase_timings(out, compute_s=first_at - start - out.queue_seconds),
                    )
                if out.kv_saved is not None:
                    saved = out.kv_saved
                    if saved.error:
                        # The router gets UNAVAILABLE (trailer kv-save-failed) after the first
                        # token: no handle will come, and the store, not this instance, is at
                        # fault, so decode computes the prompt itself.
                        raise KVSaveFailed(f"KV save of request {request_id} failed: {saved.error}")
                    timings = phase_timings(
                        out,
                        compute_s=(first_at or time.monotonic()) - start - out.queue_seconds,
                        kv_save_s=saved.seconds,
                    )
                    core.metrics.observe_timings(timings)
                    handle = kv_handle(core.engine, saved, self._connector_name)
                    # What the decode side checks against its own copy (docs/design.md §3 "LoRA").
                    handle.lora_identity = lora_identity(core.engine, request.lora_name)
                    yield pb.PrefillEvent(kv_committed=handle, timings=timings)
                    committed = True  # the last output; the engine's stream ends right after
        if committed:
            return
        if last is not None and last.finish_reason == "abort":
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request_id} was aborted")
        raise RuntimeError(f"engine finished request {request_id} without reporting its saved KV")

    @staticmethod
    def _first_token(out: Any) -> pb.FirstToken:
        """The first token; ``finished`` only when the request itself ends there (EOS or a
        stop condition) — the forced ``max_tokens=1`` of prefill is not an ending."""
        stopped = out.finish_reason == "stop"
        logprobs = logprobs_to_proto(out.logprobs)
        return pb.FirstToken(
            token_id=out.new_token_ids[0],
            text=out.new_text,
            logprob=logprobs[0] if logprobs else None,
            num_cached_tokens=out.num_cached_tokens,
            finished=stopped,
            finish_reason="stop" if stopped else "",
            prompt_logprobs=logprobs_to_proto(out.prompt_logprobs),
        )
