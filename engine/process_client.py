"""``ProcessEngineClient``: the ``EngineClient`` whose engine runs in a process of its own
(docs/design.md §3 "Engine thread or engine process"; the child is engine/engine_process.py).

The service process keeps only the streams: ``submit`` and ``abort`` queue commands that a
sender thread writes to the engine process (the event loop never blocks on the pipe), and
a receiver thread reads the engine's messages in order and hands each step's outputs to the
event loop in one ``call_soon_threadsafe``, as ``AsyncLLMEngine`` does from its thread.
Each use of a request id has a generation number that travels with the request and comes
back on its outputs, so an output made for an earlier use of a reused id (still on its
way when the id was used again) is dropped. KV events are numbered and fanned out here
(engine/kv/event_relay.py). When the engine process exits, every open request fails with
``EngineDeadError`` and ``fatal_error`` says why, so the service stops and is restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from engine.client import GenerateRequest, LoRAView
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.engine_loop import EngineDeadError
from engine.engine_process import GIL_SWITCH_S, EngineInfo, run_engine_process, unpack_output
from engine.kv.event_relay import KvEventRelay
from engine.kv.events import KvEventPublisher
from engine.models import ModelArgs
from engine.output_stream import OutputStream, RequestStreams, StreamBatch, fan_out
from engine.stats import EngineStats, LoadStats
from kv_store.base import KvLayout

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # a large model's load and graph captures
CALL_TIMEOUT_S = 120.0  # a LoRA adapter read from disk, a stats read
STOP_TIMEOUT_S = 10.0


class ProcessEngineClient:
    """``store``: the connector's settings (``KVStoreSettings``), built in the engine
    process with ``host``, where p2p serves pulls; None for no connector.
    ``torch_threads``: the engine process's torch threads (0: torch's default)."""

    def __init__(
        self,
        config: EngineConfig,
        store: Any = None,
        host: str = "127.0.0.1",
        torch_threads: int = 0,
    ) -> None:
        self._config = config
        self._torch_threads = torch_threads
        self._store = store
        self._host = host
        self._info: EngineInfo | None = None
        self._process: Any = None
        self._commands: Connection | None = None
        self._messages: Connection | None = None
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams = RequestStreams()
        self._load = LoadStats(0, 0, 0, 0, 0.0)
        self._lora: LoRAView | None = None
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._alive = False
        self._stopping = False  # the service asked the engine process to stop
        self._threads: list[threading.Thread] = []
        self.fatal_error: BaseException | None = None
        self._relay = (
            KvEventRelay(config.kv_events_max_queue, lambda: self._post(("snapshot",)))
            if config.kv_events
            else None
        )
        self.kv_events: KvEventPublisher | None = self._relay.publisher if self._relay else None

    # -- what the service reads -----------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineDeadError("the engine process has not started")
        return self._info

    @property
    def config(self) -> EngineConfig:
        return self.info.config

    @property
    def tokenizer(self) -> Any:
        raise AttributeError("the tokenizer lives in the engine process")

    @property
    def model_fingerprint(self) -> str:
        return self.info.model_fingerprint

    @property
    def kv_layout(self) -> KvLayout:
        return self.info.kv_layout

    @property
    def args(self) -> ModelArgs:
        return self.info.args

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def connector_name(self) -> str | None:
        return self.info.connector_name

    # -- life -----------------------------------------------------------------------------
    async def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Start the engine process and wait until its engine is built; raises what made
        the start fail there (a bad model path, an unreachable store), or ``TimeoutError``."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked into a child
        commands_r, commands_w = ctx.Pipe(duplex=False)
        messages_r, messages_w = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel()
        self._process = ctx.Process(
            target=run_engine_process,
            args=(
                *(self._config, self._store, self._host, commands_r, messages_w),
                *(level, self._torch_threads),
            ),
            name="pdserve-engine",
        )
        self._process.start()
        commands_r.close()
        messages_w.close()
        self._commands, self._messages = commands_w, messages_r
        try:
            first = await asyncio.to_thread(self._first_message, timeout)
        except BaseException:
            await self._stop_process()
            raise
        if first[0] != "ready":
            await self._stop_process()
            raise first[1]
        self._info = first[1]
        self._lora = self._info.lora
        self._alive = True
        for target, name in ((self._send_loop, "engine-send"), (self._receive_loop, "engine-recv")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _first_message(self, timeout: float) -> tuple[Any, ...]:
        assert self._messages is not None
        if not self._messages.poll(timeout):
            raise TimeoutError(f"the engine process was not ready within {timeout:.0f} s")
        try:
            message: tuple[Any, ...] = self._messages.recv()
        except EOFError:
            code = self._process.exitcode if self._process is not None else None
            raise EngineDeadError(
                f"the engine process exited while starting (code {code})"
            ) from None
        return message

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        await self._stop_process(timeout)

    async def _stop_process(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        self._post(("stop",))
        self._outbox.put(None)  # the sender ends once the stop is written
        process = self._process
        if process is not None:
            await asyncio.to_thread(process.join, timeout)
            if process.is_alive():
                logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
                process.kill()
                await asyncio.to_thread(process.join, timeout)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, timeout)

    # -- requests -------------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream output deltas until the request finishes (``ValueError`` for bad input);
        leaving the iteration early aborts the request."""
        request_id = request.request_id

        def start(stream: OutputStream) -> None:
            if not self._alive:
                raise EngineDeadError("the engine process is not running")
            self._post(("add", stream.generation, request))

        return self._streams.follow(request_id, start, lambda: self._post(("abort", request_id)))

    async def abort(self, request_id: str) -> bool:
        found = request_id in self._streams
        self._post(("abort", request_id))
        return found

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        result: list[str] = await asyncio.wrap_future(self._call("lora_add", name, path))
        return result

    async def unload_lora_adapter(self, name: str) -> list[str]:
        result: list[str] = await asyncio.wrap_future(self._call("lora_remove", name))
        return result

    def get_load(self) -> LoadStats:
        """Load as of the engine's last step (any thread)."""
        return self._load

    def lora_view(self) -> LoRAView | None:
        """The adapters as the engine process last said (before any LoRA call's reply)."""
        return self._lora

    def stats(self) -> EngineStats:
        """Read from the engine process now (``CALL_TIMEOUT_S`` at most); never call it
        on the event loop, which it would block (the metrics scrape runs on a thread)."""
        stats: EngineStats = self._call("stats").result(CALL_TIMEOUT_S)
        stats.kv_events = self.kv_events.stats if self.kv_events is not None else None
        return stats

    def _call(self, name: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        if not self._alive:
            future.set_exception(EngineDeadError("the engine process is not running"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._post(("call", call_id, name, args))
        return future

    def _post(self, command: tuple[Any, ...]) -> None:
        self._outbox.put(command)

    # -- the sender and receiver threads --------------------------------------------------
    def _send_loop(self) -> None:
        assert self._commands is not None
        while (command := self._outbox.get()) is not None:
            try:
                self._commands.send(command)
            except (OSError, ValueError):  # the engine process is gone
                return

    def _receive_loop(self) -> None:
        assert self._messages is not None and self._loop is not None
        loop, lookup, relay = self._loop, self._streams.lookup, self._relay
        why: BaseException | None = None
        while True:
            try:
                message = self._messages.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "step":
                _, items, self._load = message
                batch: StreamBatch = [
                    (s, unpack_output(rid, item))
                    for rid, gen, item in items
                    if (s := lookup(rid, gen)) is not None
                ]
                if batch:
                    loop.call_soon_threadsafe(fan_out, batch)
            elif kind == "load":
                self._load = message[1]
            elif kind == "lora":
                self._lora = message[1]
            elif kind == "events" and relay is not None:
                relay.received(message[1])
            elif kind == "snapshot" and relay is not None:
                relay.snapshot_received(message[1])
            elif kind == "reply":
                _, call_id, ok, value = message
                future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_result(value) if ok else future.set_exception(value)
            elif kind == "fatal":
                why = message[1]
        self._ended(why)

    def _ended(self, why: BaseException | None) -> None:
        """The engine process is gone: fail what waits on it. Unless the service stopped
        it, that is for good (``fatal_error``: the service exits and is restarted)."""
        self._alive = False
        self._outbox.put(None)
        if self._process is not None:
            self._process.join(STOP_TIMEOUT_S)
        code = self._process.exitcode if self._process is not None else None
        if why is None and self._stopping:
            dead = EngineDeadError("the engine is shutting down")
        else:
            dead = EngineDeadError(f"the engine process stopped: {why or f'exit code {code}'}")
            self.fatal_error = why or dead
            logger.error("%s", dead)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(dead)
        self._calls.clear()
        if self.kv_events is not None:
            self.kv_events.close(str(dead))
        streams: StreamBatch = [(s, dead) for s in self._streams.all()]
        if streams and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fan_out, streams)
