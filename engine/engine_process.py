"""The engine core in a process of its own (docs/design.md §3 "Engine thread or engine
process"): the child side of ``engine/process_client.py``.

Why: beside an engine thread, the service's event loop (gRPC's per-message work, the
output fan-out) takes the GIL from the step loop for tens of microseconds a token; in a
process of its own the step loop has an interpreter to itself, as vLLM's engine core does.

The process builds the connector and the ``LLMEngine``, says ``ready`` with what the service
needs to know of them (``EngineInfo``), then runs the same ``EngineLoop`` as the thread does.
A reader thread takes the service's commands off the pipe at once (so a long step never
blocks the service's writes) and queues them for the next step boundary. Messages to the
service, in one ordered pipe: ``step`` (one step's outputs, each tagged with the generation
of its request id's use, engine/engine_loop.py, and the load), ``events`` (a command pass's KV events), ``snapshot``
(what the KV tiers hold, after the events sent before it), ``load`` (the load changed
between steps), ``reply`` (a call's answer),
``lora`` (the adapters served or resident changed), ``failed`` (the start failed) and ``fatal`` (the engine died for good).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from common.parent_death import die_with_parent
from engine.client import LoRAView
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.engine_loop import Abort, Delivery, EngineLoop, RunOnLoop, Submit
from engine.kv.events import snapshot_held
from engine.llm_engine import LLMEngine
from engine.lora_serving import add_adapter, lora_view, remove_adapter
from engine.models import ModelArgs
from engine.stats import EngineStats, LoadStats
from kv_store.base import KvLayout

logger = logging.getLogger(__name__)

GIL_SWITCH_S = 0.001


@dataclass(frozen=True)
class EngineInfo:
    """What the service reads of the engine once it started."""

    config: EngineConfig
    model_fingerprint: str
    kv_layout: KvLayout
    args: ModelArgs
    max_model_len: int
    connector_name: str | None
    lora: LoRAView | None  # the adapters served at the start (None: LoRA is off)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` that says what it was
    (the service maps ``ValueError`` and the like by type, so those stay themselves)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineProcessCore:
    """The engine loop and its two pipes (this process's main thread runs ``run``)."""

    def __init__(self, engine: LLMEngine, commands: Connection, messages: Connection) -> None:
        self.engine = engine
        self._commands = commands
        self._messages = messages
        self._send_lock = threading.Lock()  # the loop and the reader both send
        self._sent_load: LoadStats | None = None
        self._sent_lora: LoRAView | None = lora_view(engine.lora)  # EngineInfo carries it
        self.loop = EngineLoop(engine, self._deliver, self._between_steps)

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._messages.send(message)

    def run(self) -> None:
        reader = threading.Thread(target=self._read, name="engine-commands", daemon=True)
        reader.start()
        self.loop.run()
        if self.loop.fatal_error is not None:
            self.send(("fatal", portable(self.loop.fatal_error)))

    # -- the loop thread ----------------------------------------------------------------
    def _deliver(self, items: Delivery) -> None:
        """One message per step that made outputs, with the load after it (a step that
        made none leaves its load to ``_between_steps``)."""
        if not items:
            return
        self._sent_load = self.loop.load
        portable_items = [(rid, gen, portable_item(item)) for rid, gen, item in items]
        self.send(("step", portable_items, self._sent_load))

    def _between_steps(self) -> None:
        self._send_events()
        load = self.loop.load
        if load != self._sent_load:  # a step without outputs, an abort or an idle engine
            self._sent_load = load
            self.send(("load", load))
        if self.engine.lora is not None:
            self.send_lora_view()

    def send_lora_view(self) -> None:
        """The adapters served and resident, when they changed. Read under the send lock,
        so the views leave in the order they were read (a LoRA call's and the loop's)."""
        with self._send_lock:
            view = lora_view(self.engine.lora)
            if view != self._sent_lora:
                self._sent_lora = view
                self._messages.send(("lora", view))

    def _send_events(self) -> None:
        log = self.engine.kv_events
        if log:  # None when events are off; empty when the pass made none
            self.send(("events", log.drain()))

    def _snapshot(self) -> None:
        self._send_events()  # the snapshot is the state after every event sent before it
        host = self.engine.host_tier
        held = snapshot_held(self.engine.kv, host.parents() if host is not None else None)
        self.send(("snapshot", held))

    # -- the reader thread --------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                command = self._commands.recv()
            except (EOFError, OSError):
                command = ("stop",)  # the service is gone: stop serving
            kind = command[0]
            if kind == "add":
                self.loop.send(Submit(command[2], command[1]))
            elif kind == "abort":
                self.loop.send(Abort(command[1]))
            elif kind == "snapshot":
                self.loop.send(RunOnLoop(self._snapshot))
            elif kind == "call":
                self._answer(command[1], command[2], command[3])
            elif kind == "stop":
                self.loop.stop()
                return

    def _answer(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        """A call of the service's (off the loop thread, as the thread engine makes them)."""
        try:
            value: Any = CALLS[name](self, *args)
            self.send(("reply", call_id, True, value))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            self.send(("reply", call_id, False, portable(exc)))


def portable_item(item: RequestOutput | BaseException) -> Any:
    """What crosses the pipe for one delivery: an error that survives pickling; a plain
    delta (tokens and text, nothing of KV, logprobs or errors) as a tuple of its fields,
    a third of the pickling time of the dataclass on the engine's thread; else the
    ``RequestOutput`` itself. ``unpack_output`` undoes it."""
    if isinstance(item, BaseException):
        return portable(item)
    if (
        item.logprobs is None
        and item.prompt_logprobs is None
        and item.kv_saved is None
        and item.error is None
        and not (item.kv_load_seconds or item.kv_blocks_loaded or item.kv_blocks_recomputed)
        and not (item.kv_blocks_local or item.kv_bytes_loaded)
    ):
        return (
            *(item.new_token_ids, item.new_text, item.finished, item.finish_reason),
            *(item.num_prompt_tokens, item.num_cached_tokens, item.queue_seconds),
        )
    return item


def unpack_output(request_id: str, item: Any) -> RequestOutput | BaseException:
    """The delivery ``portable_item`` packed, in the service process."""
    if not isinstance(item, tuple):
        return item  # type: ignore[no-any-return]
    tokens, text, finished, reason, prompt, cached, queued = item
    return RequestOutput(
        request_id, tokens, text, finished, reason,
        num_prompt_tokens=prompt, num_cached_tokens=cached, queue_seconds=queued,
    )  # fmt: skip


def _lora_add(core: EngineProcessCore, name: str, path: str) -> list[str]:
    served = add_adapter(core.engine.lora, name, path)
    core.send_lora_view()  # before the reply: a request naming it may follow at once
    return served


def _lora_remove(core: EngineProcessCore, name: str) -> list[str]:
    served = remove_adapter(core.engine.lora, name)
    core.send_lora_view()
    return served


def _stats(core: EngineProcessCore) -> EngineStats:
    return core.engine.stats(core.loop.load)


CALLS: dict[str, Callable[..., Any]] = {
    "lora_add": _lora_add,
    "lora_remove": _lora_remove,
    "stats": _stats,
}


def _owned_by_the_service() -> None:
    """The service alone stops this process: SIGINT and SIGTERM sent to the process group
    (Ctrl-C, `pdserve up`'s stop) are ignored, so the service's drain finishes its requests
    first; and the process is killed if the service dies (Linux's parent-death signal;
    the closed command pipe stops it too, once its step ends)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid, signal.SIGKILL)


def configure_threads(torch_threads: int) -> None:
    """Apply ``--torch-threads`` before any torch work (the launcher hands out fair shares)."""
    if torch_threads <= 0:
        return
    import torch

    torch.set_num_threads(torch_threads)
    # RuntimeError if an earlier parallel region already fixed it: harmless.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def run_engine_process(
    config: EngineConfig,
    store: Any,
    host: str,
    commands: Connection,
    messages: Connection,
    log_level: int,
    torch_threads: int,
) -> None:
    """The process's entry (``multiprocessing`` spawn): build, say ready, serve, close."""
    _owned_by_the_service()
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s"
    )
    sys.setswitchinterval(GIL_SWITCH_S)
    configure_threads(torch_threads)
    try:
        from kv_store.factory import build_connector

        connector = build_connector(store, host) if store is not None else None
        engine = LLMEngine(config, connector)
    except BaseException as exc:  # noqa: BLE001 - the service reports why it cannot start
        logger.exception("the engine could not start")
        messages.send(("failed", portable(exc)))
        return
    core = EngineProcessCore(engine, commands, messages)
    info = EngineInfo(
        engine.config,
        engine.model_fingerprint,
        engine.kv_layout,
        engine.args,
        engine.max_model_len,
        getattr(connector, "name", None) if connector is not None else None,
        lora_view(engine.lora),
    )
    core.send(("ready", info))
    try:
        core.run()
    finally:
        engine.close_kv()
        engine.shutdown()
