"""The asynchronous engine that services drive, on a thread of the service process.

The synchronous ``LLMEngine`` runs in an ``EngineLoop`` (engine/engine_loop.py: the command
queue, one pass of commands per step boundary) on one background thread (torch releases
the GIL in its kernels, so the asyncio loop stays responsive). Each step's outputs come
back to the event loop in one hand-off (one ``call_soon_threadsafe`` per step, not per
request), which fans them out to the requests' ``OutputStream``s; a stream whose consumer
fell behind hands it the queued deltas merged into one (engine/output_stream.py,
docs/design.md §3 "Output streams"). ``engine/process_client.py`` is the same client with
the loop in a process of its own (docs/design.md §3 "Engine thread or engine process").
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from engine.client import GenerateRequest, LoRAView
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.engine_loop import Abort, Delivery, EngineDeadError, EngineLoop, Submit
from engine.kv.event_relay import pump_kv_events
from engine.kv.events import Held, KvEventPublisher, snapshot_held
from engine.llm_engine import LLMEngine
from engine.lora_serving import add_adapter, lora_view, remove_adapter
from engine.models import ModelArgs
from engine.output_stream import OutputStream, RequestStreams, fan_out
from engine.stats import EngineStats, LoadStats
from kv_store.base import KVConnector, KvLayout

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

logger = logging.getLogger(__name__)

GIL_SWITCH_S = 0.001


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None) -> None:
        self.engine = LLMEngine(config, connector)
        self._core = EngineLoop(self.engine, self._deliver, self._publish_kv_events)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams = RequestStreams()
        self.kv_events = self._publisher()  # None when KV events are off

    def _publisher(self) -> KvEventPublisher | None:
        engine = self.engine
        if engine.kv_events is None:
            return None
        host = engine.host_tier

        def snapshot() -> Held:
            return snapshot_held(engine.kv, host.parents() if host is not None else None)

        return KvEventPublisher(
            engine.kv_events, snapshot, engine.config.kv_events_max_queue, self._core.wake.set
        )

    @property
    def fatal_error(self) -> BaseException | None:
        """Why the engine died for good (an executor failure), else None."""
        return self._core.fatal_error

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_fingerprint(self) -> str:
        return self.engine.model_fingerprint

    @property
    def kv_layout(self) -> KvLayout:
        return self.engine.kv_layout

    @property
    def args(self) -> ModelArgs:
        """The model's (global) shape: a handle of another grid is re-cut with it."""
        return self.engine.args

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def start(self) -> None:
        # The step loop holds the GIL through Python-heavy bookkeeping; with the default
        # 5 ms switch interval the asyncio thread (gRPC, HTTP) can wait that long to hand
        # in a request or forward a token. 1 ms keeps TTFT/ITL overhead low.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        self._core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self.engine.close_kv()
        self.engine.shutdown()

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_token_ids: list[int] | None = None,
        remote_kv: RemoteKV | None = None,
        save_kv: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """``submit`` with the request's fields spelled out."""
        return self.submit(
            GenerateRequest(
                request_id, prompt_token_ids, params, output_token_ids, remote_kv, save_kv, priority
            )
        )

    def submit(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream output deltas until the request finishes. Raises ValueError for bad
        input. Leaving the loop early (cancel, disconnect) aborts the request."""
        request_id = request.request_id

        def start(stream: OutputStream) -> None:
            if self._thread is None or not self._thread.is_alive():
                raise EngineDeadError("the engine loop is not running")
            self._core.send(Submit(request, stream.generation))

        return self._streams.follow(request_id, start, lambda: self._core.send(Abort(request_id)))

    async def abort(self, request_id: str) -> bool:
        found = request_id in self._streams
        self._core.send(Abort(request_id))
        return found

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Register a LoRA adapter at runtime (read and checked off the event loop);
        ``ValueError`` with the reason for a bad one. Returns the adapters served now."""
        return await asyncio.to_thread(add_adapter, self.engine.lora, name, path)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """Forget a LoRA adapter (running requests finish with it)."""
        return remove_adapter(self.engine.lora, name)

    def get_load(self) -> LoadStats:
        """Load as of the last engine step (safe to call from any thread)."""
        return self._core.load

    def lora_view(self) -> LoRAView | None:
        return lora_view(self.engine.lora)

    def stats(self) -> EngineStats:
        """Load as of the last engine step, with the counters read now (any thread)."""
        stats = self.engine.stats(self._core.load)
        stats.kv_events = self.kv_events.stats if self.kv_events is not None else None
        return stats

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._core.run()
        if self.kv_events is not None:
            self.kv_events.close()  # subscribers learn at once that no more batches come

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            pump_kv_events(self.kv_events)

    def _deliver(self, items: Delivery) -> None:
        """Hand a step's outputs to the event loop in one call: each ``call_soon_threadsafe``
        writes the loop's self-pipe and wakes it, and takes the GIL from the engine thread
        when it runs, so one per step instead of one per request (docs/design.md §3 "Output streams").
        Streams are looked up by the generation each output carries: one opened later under
        a reused request id never receives an earlier request's output."""
        lookup = self._streams.lookup
        batch = [(s, item) for rid, gen, item in items if (s := lookup(rid, gen)) is not None]
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(fan_out, batch)
