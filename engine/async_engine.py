"""The asynchronous engine that services drive.

The synchronous ``LLMEngine`` runs on one background thread (torch releases the GIL in its
kernels, so the asyncio loop stays responsive). Requests and aborts reach it through one
command queue, in order (an abort never overtakes its own request's add, nor a later
request that reuses the id), and the engine thread drains every pending command in one pass
at each step boundary: a storm of cancelled streams costs the engine one pass per step, no
lock or step per abort. Each step's outputs come back to the event loop in one hand-off
(one ``call_soon_threadsafe`` per step, not per request), which fans them out to the
requests' ``OutputStream``s; a stream whose consumer fell behind hands it the queued deltas
merged into one (engine/output_stream.py, docs/design.md §3 "Output streams").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.client import GenerateRequest
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams
from engine.executor import ExecutorFailure
from engine.kv.events import Held, KvEventPublisher, snapshot_held
from engine.llm_engine import LLMEngine
from engine.models import ModelArgs
from engine.output_stream import OutputStream
from engine.stats import EngineStats, LoadStats
from kv_store.base import KVConnector, KvLayout

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_TRANSFER_POLL_S = 0.001
_GIL_SWITCH_S = 0.001


class EngineDeadError(RuntimeError):
    """The engine loop is not running (not started, shut down, or crashed)."""


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None) -> None:
        self.engine = LLMEngine(config, connector)
        self._commands: queue.SimpleQueue[GenerateRequest | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        self._load = self.engine.get_load()
        self.fatal_error: BaseException | None = None  # set when the engine died for good
        self.kv_events = self._publisher()  # None when KV events are off

    def _publisher(self) -> KvEventPublisher | None:
        engine = self.engine
        if engine.kv_events is None:
            return None
        host = engine.host_tier

        def snapshot() -> Held:
            return snapshot_held(engine.kv, host.parents() if host is not None else None)

        return KvEventPublisher(
            engine.kv_events, snapshot, engine.config.kv_events_max_queue, self._wake.set
        )

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
        sys.setswitchinterval(min(sys.getswitchinterval(), _GIL_SWITCH_S))
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        self._stop.set()
        self._wake.set()
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

    async def submit(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream output deltas until the request finishes. Raises ValueError for bad
        input. Leaving the loop early (cancel, disconnect) aborts the request."""
        request_id = request.request_id
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = OutputStream()
        self._streams[request_id] = stream
        self._send(request)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> bool:
        found = request_id in self._streams
        self._send(_Abort(request_id))
        return found

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Register a LoRA adapter at runtime (read and checked off the event loop);
        ``ValueError`` with the reason for a bad one. Returns the adapters served now."""
        lora = self.engine.lora
        if lora is None:
            raise ValueError("LoRA is not enabled on this instance (start it with --enable-lora)")
        await asyncio.to_thread(lora.add_adapter, name, path)
        return sorted(lora.manager.registry)

    def unload_lora_adapter(self, name: str) -> list[str]:
        """Forget a LoRA adapter (running requests finish with it)."""
        lora = self.engine.lora
        if lora is None:
            raise ValueError("LoRA is not enabled on this instance (start it with --enable-lora)")
        lora.remove_adapter(name)
        return sorted(lora.manager.registry)

    def get_load(self) -> LoadStats:
        """Load as of the last engine step (safe to call from any thread)."""
        return self._load

    def stats(self) -> EngineStats:
        """Load as of the last engine step, with the counters read now (any thread)."""
        stats = self.engine.stats(self._load)
        stats.kv_events = self.kv_events.stats if self.kv_events is not None else None
        return stats

    def _send(self, command: GenerateRequest | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_commands()
            self._publish_kv_events()  # the last step's, and snapshots for new subscribers
            if not engine.has_unfinished():
                self._load = engine.get_load()
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            steps_before = engine.num_steps
            try:
                outputs = engine.step()
            except ExecutorFailure as exc:  # no later step can run: the engine is dead
                logger.error("engine failed for good: %s", exc)
                self.fatal_error = exc
                self._fail_all(exc)
                break
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("engine step failed; failing in-flight requests")
                self._fail_all(exc)
                continue
            self._load = engine.get_load()
            self._deliver([(out.request_id, out) for out in outputs])
            if engine.num_steps == steps_before and not outputs:
                self._wake.wait(_TRANSFER_POLL_S)  # only transfers in flight: poll gently
                self._wake.clear()
        self._fail_all(EngineDeadError("the engine is shutting down"))
        if self.kv_events is not None:
            self.kv_events.close()  # subscribers learn at once that no more batches come

    def _publish_kv_events(self) -> None:
        if self.kv_events is None:
            return
        try:
            self.kv_events.pump()
        except Exception:  # a bug here must not stop serving: end the streams instead
            logger.exception("publishing KV events failed; no more KV event streams here")
            self.kv_events.close("KV events failed on this instance (see its log)")

    def _drain_commands(self) -> None:
        refused: list[tuple[str, RequestOutput | BaseException]] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, GenerateRequest):
                try:
                    self.engine.add(cmd)
                except (ValueError, TypeError) as exc:
                    refused.append((cmd.request_id, exc))
            else:
                self.engine.abort_request(cmd.request_id)
        self._deliver(refused)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to the event loop in one call: each ``call_soon_threadsafe``
        writes the loop's self-pipe and wakes it, and takes the GIL from the engine thread
        when it runs, so one per step instead of one per request (docs/design.md §3 "Output streams").
        Streams are looked up here, as the outputs are made: one registered later under a
        reused request id never receives an earlier request's output."""
        streams = self._streams
        batch = [(s, item) for rid, item in items if (s := streams.get(rid)) is not None]
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_fan_out, batch)

    def _fail_all(self, exc: BaseException) -> None:
        failed: list[tuple[str, RequestOutput | BaseException]] = []
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            failed.append((request_id, exc))
        self._deliver(failed)


def _fan_out(batch: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    """On the event loop: each output into its request's stream."""
    for stream, item in batch:
        stream.put(item)
