"""The engine's driving loop, shared by both ways a service runs it (docs/design.md §3
"Engine thread or engine process"): ``AsyncLLMEngine`` runs it on a thread of the service
process, ``engine/engine_process.py`` on the main thread of a process of its own.

Requests and aborts reach it through one command queue, in order (an abort never overtakes
its own request's add, nor a later request that reuses the id), and the loop drains every
pending command in one pass at each step boundary: a storm of cancelled streams costs the
engine one pass per step, no lock or step per abort. Each step's outputs leave in one call of
``deliver`` (one hand-off per step, not per request).

Every output leaves tagged with the generation its request was submitted with (the client
numbers each use of a request id): an aborted request's last output, made when the abort is
read, carries the old use's even when a new request with the same id follows in the same
pass, so the client hands it to the old stream (gone) and never to the new one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.client import GenerateRequest
from engine.core.outputs import RequestOutput
from engine.executor import ExecutorFailure
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_TRANSFER_POLL_S = 0.001

# (request id, the generation it was submitted with, its output or why it failed)
Delivery = list[tuple[str, int, RequestOutput | BaseException]]


class EngineDeadError(RuntimeError):
    """The engine loop is not running (not started, shut down, or crashed)."""


@dataclass(slots=True)
class Submit:
    request: GenerateRequest
    generation: int  # which use of the request id (the client's count)


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class RunOnLoop:
    """A call to make on the loop's thread between steps (a KV snapshot, say)."""

    call: Callable[[], None]


Command = Submit | Abort | RunOnLoop


class EngineLoop:
    """Steps ``engine`` while it has work; ``deliver`` gets each step's outputs and the
    requests refused or failed; ``between_steps`` runs after every command pass (KV
    events). ``fatal_error`` says why the loop ended for good (an executor failure)."""

    def __init__(
        self,
        engine: LLMEngine,
        deliver: Callable[[Delivery], None],
        between_steps: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self._deliver = deliver
        self._between_steps = between_steps
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake = threading.Event()
        self._stop = threading.Event()
        # request id -> generation, of the requests added and not yet finished or aborted
        self._active: dict[str, int] = {}
        self.load = engine.get_load()
        self.fatal_error: BaseException | None = None

    def send(self, command: Command) -> None:
        """Any thread: queue a command for the next step boundary."""
        self._commands.put(command)
        self.wake.set()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    def run(self) -> None:
        """Step until ``stop``; then every request still in the engine fails."""
        engine = self.engine
        while not self._stop.is_set():
            self._drain_commands()
            self._between_steps()
            if not engine.has_unfinished():
                self.load = engine.get_load()
                self.wake.wait(_IDLE_WAIT_S)
                self.wake.clear()
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
            self.load = engine.get_load()
            self._deliver(self._tagged(outputs))
            if engine.num_steps == steps_before and not outputs:
                self.wake.wait(_TRANSFER_POLL_S)  # only transfers in flight: poll gently
                self.wake.clear()
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _tagged(self, outputs: list[RequestOutput]) -> Delivery:
        active = self._active
        tagged: Delivery = [(o.request_id, active.get(o.request_id, 0), o) for o in outputs]
        for out in outputs:
            if out.finished:
                active.pop(out.request_id, None)
        return tagged

    def _drain_commands(self) -> None:
        """Every queued command, in order; the pass's refusals and aborts' last outputs
        leave in one delivery, each tagged as it was made."""
        ended: Delivery = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Submit):
                request_id = cmd.request.request_id
                try:
                    self.engine.add(cmd.request)
                    self._active[request_id] = cmd.generation
                except (ValueError, TypeError) as exc:
                    ended.append((request_id, cmd.generation, exc))
            elif isinstance(cmd, Abort):
                self.engine.abort_request(cmd.request_id)
                ended += self._tagged(self.engine.take_ended())  # before the id is reused
                self._active.pop(cmd.request_id, None)
            else:
                cmd.call()
        if ended:
            self._deliver(ended)

    def _fail_all(self, exc: BaseException) -> None:
        failed: Delivery = []
        for request_id, generation in sorted(self._active.items()):
            self.engine.abort_request(request_id)
            failed.append((request_id, generation, exc))
        self.engine.take_ended()
        self._active.clear()
        if failed:
            self._deliver(failed)
