"""Runtime LoRA updates (docs/lora.md): ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's endpoints and bodies), behind the API key like every
path, and only with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

A load goes to every known prefill and decode instance over gRPC (``LoadLoRAAdapter``);
the router remembers the runtime set, and after each health poll pushes what an instance
lacks (one started later, or one that was down), so every instance ends up serving the
same adapters. An unload goes to every instance and leaves the set.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc
from fastapi import FastAPI
from pydantic import BaseModel, Field

from pdserve_api.v1 import pdserve_pb2
from router.errors import APIError

if TYPE_CHECKING:
    from router.openai.deps import Deps
    from router.routing.pool import Instance, InstancePool

logger = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0  # reading and checking an adapter on an instance


class LoadLoRABody(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRABody(BaseModel):
    lora_name: str = Field(min_length=1)


class LoRASync:
    """The runtime adapter set and its push to instances that lack it."""

    def __init__(self, pools: list[InstancePool]) -> None:
        self.pools = pools
        self.loaded: dict[str, str] = {}  # name -> path, loaded through the API
        self.unloaded: set[str] = set()  # unloaded through the API
        self._pushing: set[tuple[str, str]] = set()  # (instance, name) in flight
        self._tasks: set[asyncio.Task[None]] = set()
        for pool in pools:
            pool.on_polled = self.on_polled

    def instances(self) -> list[Instance]:
        return [i for pool in self.pools for i in pool.instances()]

    async def load(self, name: str, path: str) -> int:
        """Load on every instance; the number that serve it now. 400 with the instance's
        reason when it refused the adapter; 503 when none could be reached."""
        instances = self.instances()
        results = await asyncio.gather(
            *(_call(i, "LoadLoRAAdapter", lora_name=name, lora_path=path) for i in instances)
        )
        refused = [e for e in results if isinstance(e, grpc.aio.AioRpcError) and _is_bad(e)]
        if refused and "already loaded" not in str(refused[0].details()):
            raise APIError(400, str(refused[0].details()), param="lora_path", code="invalid_value")
        done = sum(1 for r in results if not isinstance(r, BaseException)) + len(refused)
        if not done:
            raise APIError(503, "no instance could load the adapter; retry later")
        self.loaded[name] = path
        self.unloaded.discard(name)
        for inst, result in zip(instances, results, strict=True):
            if not isinstance(result, BaseException) or result in refused:
                inst.note_adapter(name, served=True)
        return done

    async def unload(self, name: str) -> None:
        served = any(name in i.load.lora_adapters for i in self.instances())
        if name not in self.loaded and not served:
            raise APIError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name")
        self.loaded.pop(name, None)
        self.unloaded.add(name)
        instances = self.instances()
        results = await asyncio.gather(
            *(_call(i, "UnloadLoRAAdapter", lora_name=name) for i in instances)
        )
        for inst, result in zip(instances, results, strict=True):
            if not isinstance(result, BaseException):
                inst.note_adapter(name, served=False)

    def on_polled(self, inst: Instance) -> None:
        """After a passing health poll: push the runtime set where it differs."""
        have = set(inst.load.lora_adapters)
        for name, path in self.loaded.items():
            if name not in have:
                self._push(inst, name, "LoadLoRAAdapter", lora_name=name, lora_path=path)
        for name in self.unloaded & have:
            self._push(inst, name, "UnloadLoRAAdapter", lora_name=name)

    def _push(self, inst: Instance, name: str, method: str, **fields: str) -> None:
        key = (inst.url, name)
        if key in self._pushing:
            return
        self._pushing.add(key)

        async def run() -> None:
            try:
                result = await _call(inst, method, **fields)
                if isinstance(result, BaseException):
                    logger.warning("%s of %s on %s failed: %s", method, name, inst.url, result)
                else:
                    logger.info("%s %s on %s (instance caught up)", method, name, inst.url)
            finally:
                self._pushing.discard(key)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _is_bad(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _call(inst: Instance, method: str, **fields: str) -> Any:
    """The RPC's reply, or the exception it raised (one instance's failure is reported,
    not raised, so a fan-out hears from all)."""
    request = (
        pdserve_pb2.LoadLoRAAdapterRequest(**fields)
        if method == "LoadLoRAAdapter"
        else pdserve_pb2.UnloadLoRAAdapterRequest(**fields)
    )
    try:
        return await getattr(inst.stub, method)(
            request, timeout=CALL_TIMEOUT_S, metadata=inst.auth.metadata(method)
        )
    except grpc.aio.AioRpcError as exc:
        return exc


def add_lora_admin_routes(app: FastAPI, deps: Deps) -> None:
    orch = deps.orchestrator
    sync = LoRASync([orch.prefill_pool, orch.decode_pool])
    app.state.lora_sync = sync

    def check_allowed() -> None:
        if not deps.settings.allow_runtime_lora_updating:
            raise APIError(
                404,
                "runtime LoRA updates are off; start the router with "
                "--allow-runtime-lora-updating (env PDSERVE_ALLOW_RUNTIME_LORA_UPDATING)",
                code="not_found",
            )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRABody) -> dict[str, Any]:
        check_allowed()
        if body.lora_name in deps.settings.served_model_names:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        count = await sync.load(body.lora_name, body.lora_path)
        return {"lora_name": body.lora_name, "instances": count}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRABody) -> dict[str, Any]:
        check_allowed()
        await sync.unload(body.lora_name)
        return {"lora_name": body.lora_name}
