"""The RPCs both services answer the same way (``Abort``, ``GetLoad``, the LoRA adapter
updates and ``SubscribeKvEvents``): one mixin, so the prefill and decode servicers only
hold what differs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio

from pdserve_api.v1 import pdserve_pb2 as pb
from service.core import EngineServiceCore, load_lora_adapter, unload_lora_adapter
from service.kv_events_rpc import subscribe_kv_events


class SharedRpcs:
    """Mixed in before the generated servicer base; the subclass sets ``_core``."""

    _core: EngineServiceCore

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return await self._core.Abort(request, context)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadInfo:
        return await self._core.GetLoad(request, context)

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdaptersReply:
        return await load_lora_adapter(self._core, request)  # type: ignore[no-any-return]

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdaptersReply:
        return await unload_lora_adapter(self._core, request)  # type: ignore[no-any-return]

    async def SubscribeKvEvents(
        self, request: pb.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        async for batch in subscribe_kv_events(self._core, context):
            yield batch
