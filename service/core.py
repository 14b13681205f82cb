"""What the prefill and decode servicers share: admission, in-flight tracking, Abort, GetLoad.

``EngineServiceCore`` owns the set of requests this service is running. A request is
admitted only while the service is not draining and (with ``max_waiting``) the engine's
queue has room; it leaves the set when its stream ends however it ends, and an unfinished
engine request is aborted then — this is how a client's cancellation or an expired deadline
frees the engine's KV blocks.

Each request remembers its owner: the authenticated identity of the peer that started it
(``common.grpc_tls.peer_identity``: its certificate's names with mTLS, "" otherwise). Only
the owner may ``Abort`` it; an Abort from anyone else answers ``found=False`` and changes
nothing (docs/design.md §3, "Control-plane security"). Owners of finished requests are
kept for a while (``RECENT_OWNERS``), because a finished prefill can still hold its KV for
a p2p pull, and Abort ends that hold.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import grpc.aio

from common.grpc_tls import peer_identity
from common.tracing import Tracing
from engine.client import EngineClient, GenerateRequest
from engine.core.outputs import RequestOutput
from pdserve_api.v1 import pdserve_pb2 as pb
from service.errors import EngineFull, ServiceUnavailable
from service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

# Owners of this many finished requests are remembered: far more than can finish within a
# p2p lease (30 s by default), so a held transfer's owner is still known when Abort comes.
RECENT_OWNERS = 65536


@dataclass(slots=True)
class EngineServiceCore:
    """State shared by a service's RPC handlers. ``engine`` is a started engine."""

    role: str
    engine: EngineClient
    metrics: ServiceMetrics
    model_name: str
    max_waiting: int = 0
    draining: bool = False
    tracing: Tracing | None = None  # --otlp-traces-endpoint (service/spans.py)
    _inflight: dict[str, str] = field(default_factory=dict)  # request id -> owner identity
    _recent: OrderedDict[str, str] = field(default_factory=OrderedDict)  # finished: owners
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def new_request_id(self, given: str) -> str:
        """The caller's id, or a fresh one; ValueError if that id is already running here."""
        request_id = given or f"{self.role}-{uuid.uuid4().hex}"
        if request_id in self._inflight:
            raise ValueError(f"request_id {request_id!r} is already in flight on this instance")
        return request_id

    def admit(self) -> None:
        """Raise unless a new request may start now (draining → UNAVAILABLE, full → RESOURCE_EXHAUSTED)."""
        if self.draining:
            raise ServiceUnavailable(
                f"{self.role} instance is draining (shutting down); use another instance"
            )
        if self.max_waiting:
            waiting = self.engine.get_load().waiting
            if waiting >= self.max_waiting:
                raise EngineFull(
                    f"{self.role} engine queue is full ({waiting} waiting); retry later or elsewhere"
                )

    async def run(
        self, request: GenerateRequest, owner: str = ""
    ) -> AsyncGenerator[RequestOutput, None]:
        """``engine.submit`` with bookkeeping: tracked (with its ``owner``, the identity that
        may abort it) while running, aborted if left early.

        Callers close it on every exit (``contextlib.aclosing``): a generator left suspended
        by an error raised in the caller's loop keeps the request counted in flight, and
        unaborted, until the cyclic GC runs, and a drain then waits its whole grace."""
        request_id = request.request_id
        self._inflight[request_id] = owner
        self._idle.clear()
        completed = False
        try:
            async for out in self.engine.submit(request):
                yield out
            completed = True
        finally:
            self._remember(request_id, self._inflight.pop(request_id, owner))
            if not self._inflight:
                self._idle.set()
            if not completed:
                # Cancelled, deadline passed or failed mid-way: free the engine's blocks now.
                await _quiet_abort(self.engine, request_id)

    def _remember(self, request_id: str, owner: str) -> None:
        self._recent[request_id] = owner
        self._recent.move_to_end(request_id)
        while len(self._recent) > RECENT_OWNERS:
            self._recent.popitem(last=False)

    def owner_of(self, request_id: str) -> str | None:
        """The identity that started ``request_id`` (running or recently finished), or None."""
        owner = self._inflight.get(request_id)
        return owner if owner is not None else self._recent.get(request_id)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until no request is in flight; True if it got there."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Abort a running request; ``found`` is False when it is unknown or already done.
        Its stream then ends with finish_reason "abort". A finished prefill whose KV is held
        for a pull (p2p) is not running, but the engine still ends its hold.

        Only the identity that started the request may abort it: another caller gets
        ``found=False`` and nothing happens (the same answer as for an unknown id, so Abort
        tells no one which other requests run here)."""
        request_id = request.request_id
        caller = peer_identity(context)
        owner = self.owner_of(request_id)
        if owner is not None and owner != caller:
            logger.warning(
                "refused Abort of %s from %r: the request belongs to %r", request_id, caller, owner
            )
            self.metrics.record_outcome("Abort", "not_owner")
            return pb.AbortResponse(found=False)
        found = request_id in self._inflight
        await self.engine.abort(request_id)
        return pb.AbortResponse(found=found)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadInfo:
        """The engine's live load (the router's ``least_load`` and ``auto`` decisions use it)."""
        load = self.engine.get_load()
        return pb.LoadInfo(
            waiting=load.waiting,  # includes requests waiting for remote KV
            running=load.running,
            free_kv_blocks=load.free_blocks,
            total_kv_blocks=load.total_blocks,
            prefix_hit_rate=load.prefix_hit_rate,
            model_fingerprint=self.engine.model_fingerprint,
            model_name=self.model_name,
            draining=self.draining,
            **lora_load_fields(self.engine),
        )


async def load_lora_adapter(core: EngineServiceCore, request: Any) -> Any:
    """``LoadLoRAAdapter`` of both services (a bad adapter is INVALID_ARGUMENT)."""
    names = await core.engine.load_lora_adapter(request.lora_name, request.lora_path)
    return pb.LoRAAdaptersReply(lora_adapters=names)


async def unload_lora_adapter(core: EngineServiceCore, request: Any) -> Any:
    names = await core.engine.unload_lora_adapter(request.lora_name)
    return pb.LoRAAdaptersReply(lora_adapters=names)


def lora_identity(engine: EngineClient, name: str) -> str:
    """The identity (name:content hash) of adapter ``name`` here; "" for the base model.
    ``ValueError`` when this instance does not serve it."""
    if not name:
        return ""
    view = engine.lora_view()
    if view is None:
        raise ValueError(f"LoRA adapter {name!r} requested but LoRA is not enabled")
    return view.identity(name)


def lora_load_fields(engine: EngineClient) -> dict[str, list[str]]:
    """The adapters an instance serves and those in a slot now (router: docs/lora.md)."""
    view = engine.lora_view()
    if view is None:
        return {}
    return {"lora_adapters": list(view.identities), "resident_lora_adapters": list(view.resident)}


async def _quiet_abort(engine: EngineClient, request_id: str) -> None:
    try:
        await asyncio.shield(engine.abort(request_id))
    except Exception:  # the request may have finished meanwhile; nothing left to free
        logger.debug("abort of %s after early exit failed", request_id, exc_info=True)
