"""Grammar compilation outside the engine process, under a time and a memory budget.

xgrammar compiles a guide into a token-level grammar in C++: seconds to minutes and
hundreds of MB for a huge enum, choice list or regex, and a thread running it can be
neither stopped nor made to give its memory back. So compiles run in a helper process
(``python -m engine.sampling.grammar_worker``, started on the first guided request; it
holds the tokenizer's xgrammar view and never compiles itself) that forks one child per
compile. The child limits its address space (``resource.setrlimit(RLIMIT_AS)``: what it
had at the fork plus ``memory_limit`` bytes), compiles, writes the serialized result back
and exits, so every byte a compile used is returned when it ends; the helper kills a child
still running after ``timeout`` seconds. The parent turns a result back into an object on
its own reader thread and hands the step loop a ready ``CompiledGrammar``: the step loop
never waits for a compile or a load (docs/guided-and-speculative.md, "Budget"). The
compiled grammar (xgrammar's JSON, up to hundreds of MB) travels as a raw payload after
its message, never inside it: parsing it as part of a JSON message held the engine
process's GIL for the whole parse (every other thread of the engine stopped); xgrammar's
own deserialization lets the step loop run most of the time
(``benchmarks/engine/grammar_load_stall.py``).

Wire: every message on the helper's stdin/stdout and on a child's pipe is an 8-byte
big-endian length and that many bytes of JSON; a message with ``"payload": n`` is followed
by ``n`` raw bytes (the compiled grammar's UTF-8 text). Parent -> helper: first
``{"tokenizer_info": ..., "share_dir": ...}``, then jobs ``{"id", "kind", "value",
"timeout", "memory"}``; helper -> parent: ``{"ready": true}``, then one reply per job:
``{"id", "ok": true, "payload": n, "shared": true?}`` + the compiled text (``shared``: loaded from the
directory other instances' compiles are left in, ``grammar_share.py``) or ``{"id", "ok":
false, "reason": "timeout" | "memory" | "invalid", "error": ...}``.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.sampling.grammar_share import GrammarShare

_LEN = 8
READY_TIMEOUT_S = 120.0  # the helper imports xgrammar (and torch): slow on a busy machine
MAX_CHILDREN = 2  # compiles at once; more wait in the helper's queue


class CompileRefused(Exception):
    """A compile over its budget or that failed; ``reason`` is timeout, memory or invalid."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- framing ------------------------------------------------------------------------------
def _frame(msg: dict[str, Any], payload: bytes = b"") -> bytes:
    """One message; with ``payload``, its raw bytes follow (``"payload"``: their length)."""
    if payload:
        msg = {**msg, "payload": len(payload)}
    body = json.dumps(msg).encode()
    return len(body).to_bytes(_LEN, "big") + body + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> dict[str, Any] | None:
    head = _read_exact(fd, _LEN)
    if head is None:
        return None
    body = _read_exact(fd, int.from_bytes(head, "big"))
    return None if body is None else json.loads(body)


def _read_payload(fd: int, n: int) -> bytearray | None:
    """``n`` raw bytes read straight into one buffer (``os.readv`` lets go of the GIL; no
    join, no copy of a large grammar under the GIL)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        read = os.readv(fd, [view[got:]])
        if not read:
            return None
        got += read
    return buf


# -- parent side --------------------------------------------------------------------------
@dataclass(slots=True)
class GrammarWorker:
    """The engine's handle on the helper process. ``submit`` returns a Future that resolves
    to ``decode(serialized)`` (the parent's CompiledGrammar) or fails with
    ``CompileRefused``. ``tokenizer_info`` is called once, when the helper starts."""

    tokenizer_info: Callable[[], str]
    decode: Callable[[str], Any]
    share_dir: str = ""  # compiled grammars shared with other instances (grammar_share.py)
    shared_loads: int = 0  # compiles answered from the shared directory (metrics)
    compiled: int = 0  # compiles this instance's children ran to a result (metrics)
    _proc: subprocess.Popen[bytes] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _futures: dict[int, Future[Any]] = field(default_factory=dict)
    _queued: list[dict[str, Any]] = field(default_factory=list)  # until the helper is up
    _starting: bool = False
    _next_id: int = 0

    def submit(self, kind: str, value: str, timeout: float, memory: int) -> Future[Any]:
        """Queue a compile; never blocks on the helper (its first start runs on a thread)."""
        future: Future[Any] = Future()
        with self._lock:
            self._next_id += 1
            job = {"id": self._next_id, "kind": kind, "value": value, "timeout": timeout,
                   "memory": memory}  # fmt: skip
            self._futures[self._next_id] = future
            if self._proc is not None and self._proc.poll() is None:
                self._send([job])
            else:
                self._queued.append(job)
                if not self._starting:
                    self._starting = True
                    threading.Thread(target=self._start, daemon=True).start()
        return future

    def _send(self, jobs: list[dict[str, Any]]) -> None:
        """Write ``jobs`` to the running helper (lock held); a failed write fails them."""
        assert self._proc is not None and self._proc.stdin is not None
        for job in jobs:
            try:
                _write_all(self._proc.stdin.fileno(), _frame(job))
            except OSError as exc:
                self._fail([job["id"]], f"the grammar helper is gone ({exc})")

    def _fail(self, ids: list[int], why: str) -> None:
        for job_id in ids:
            future = self._futures.pop(job_id, None)
            if future is not None:
                future.set_exception(CompileRefused("invalid", why))

    def _start(self) -> None:
        """Start the helper, then hand it every job queued meanwhile."""
        try:
            proc = self._spawn()
        except (OSError, CompileRefused) as exc:
            with self._lock:
                self._starting = False
                queued, self._queued = self._queued, []
                self._fail([j["id"] for j in queued], f"grammar helper: {exc}")
            return
        threading.Thread(target=self._read_replies, args=(proc,), daemon=True).start()
        with self._lock:
            self._proc, self._starting = proc, False
            queued, self._queued = self._queued, []
            self._send(queued)

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.sampling.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert proc.stdin is not None and proc.stdout is not None
        hello = {"tokenizer_info": self.tokenizer_info(), "share_dir": self.share_dir}
        _write_all(proc.stdin.fileno(), _frame(hello))
        if not _ready_within(proc.stdout.fileno(), READY_TIMEOUT_S):
            proc.kill()
            proc.wait()
            raise CompileRefused("invalid", "the grammar helper did not start")
        return proc

    def _read_replies(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while (msg := _read_frame(fd)) is not None:
            payload = _read_payload(fd, int(msg.get("payload", 0)))
            if payload is None:
                break
            with self._lock:
                future = self._futures.pop(int(msg["id"]), None)
            if future is None:
                continue
            if not msg["ok"]:
                future.set_exception(CompileRefused(msg["reason"], msg["error"]))
                continue
            if msg.get("shared"):
                self.shared_loads += 1
            else:
                self.compiled += 1
            try:
                future.set_result(self.decode(payload.decode()))
            except Exception as exc:  # noqa: BLE001 - a bad result fails its requests only
                future.set_exception(CompileRefused("invalid", f"compiled grammar: {exc}"))
        with self._lock:  # the helper is gone: fail what it held; the next submit restarts it
            lost, self._futures = self._futures, {}
            if self._proc is proc:
                self._proc = None
        for future in lost.values():
            future.set_exception(CompileRefused("invalid", "the grammar helper exited"))

    def shutdown(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _ready_within(fd: int, timeout: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        if not sel.select(timeout):
            return False
    msg = _read_frame(fd)
    return bool(msg and msg.get("ready"))


# -- helper process -----------------------------------------------------------------------
@dataclass(slots=True)
class _Child:
    job: int
    pid: int
    fd: int
    deadline: float
    timeout: float
    memory: int
    data: bytearray = field(default_factory=bytearray)


def _compile_in_child(
    compiler: Any, info: Any, share: GrammarShare, job: dict[str, Any], fd: int
) -> None:
    """In the forked child: limit memory, load the shared compile or compile (and share
    it), write the reply, exit."""
    import xgrammar as xgr

    from engine.core.guided_spec import GuidedSpec
    from engine.sampling.guide_parse import parse_guide, parser_message

    reply: dict[str, Any] = {"id": job["id"]}
    compiled = b""
    kind, value = job["kind"], job["value"]
    try:
        _limit_memory(int(job["memory"]))
        text = share.load(kind, value, lambda t: xgr.CompiledGrammar.deserialize_json(t, info))
        if text is not None:
            reply.update(ok=True, shared=True)
        else:
            grammar = parse_guide(GuidedSpec(kind, value))
            text = compiler.compile_grammar(grammar).serialize_json()
            share.store(kind, value, text)
            reply.update(ok=True)
        compiled = text.encode()
    except MemoryError as exc:
        reply.update(ok=False, reason="memory", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses the guide
        text = parser_message(exc)
        memory = "bad_alloc" in text or "memory" in text.lower()
        reply.update(ok=False, reason="memory" if memory else "invalid", error=text)
    try:
        _write_all(fd, _frame(reply, compiled))
    finally:
        os._exit(0)


def _limit_memory(extra: int) -> None:
    """Address space = what this process maps now + ``extra`` bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _refusal(child: _Child, status: int) -> dict[str, Any]:
    """The reply for a child that ended without writing one."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return {"id": child.job, "ok": False, "reason": "timeout", "error": "killed"}
    return {"id": child.job, "ok": False, "reason": "memory",
            "error": f"compile process ended with status {status}"}  # fmt: skip


def main() -> None:
    """The helper: read jobs from stdin, fork a child per job, reply on stdout."""
    inp, out = sys.stdin.buffer.fileno(), sys.stdout.buffer.fileno()
    hello = _read_frame(inp)
    if hello is None:
        return
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(hello["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    share = GrammarShare(str(hello.get("share_dir") or ""), hello["tokenizer_info"])
    _write_all(out, _frame({"ready": True}))
    queue: list[dict[str, Any]] = []
    children: dict[int, _Child] = {}  # by pipe fd
    sel = selectors.DefaultSelector()
    sel.register(inp, selectors.EVENT_READ)
    while True:
        while queue and len(children) < MAX_CHILDREN:
            job = queue.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child
                os.close(r)
                _compile_in_child(compiler, info, share, job, w)
            os.close(w)
            timeout = float(job["timeout"])
            children[r] = _Child(job["id"], pid, r, time.monotonic() + timeout, timeout,
                                 int(job["memory"]))  # fmt: skip
            sel.register(r, selectors.EVENT_READ)
        now = time.monotonic()
        wait = min((c.deadline - now for c in children.values()), default=None)
        for key, _ in sel.select(None if wait is None else max(0.0, wait)):
            if key.fd == inp:
                new = _read_frame(inp)
                if new is None:  # the engine is gone: so are we, and our children
                    for child in children.values():
                        os.kill(child.pid, signal.SIGKILL)
                    return
                queue.append(new)
                continue
            child = children[key.fd]
            chunk = os.read(key.fd, 1 << 20)
            if chunk:
                child.data += chunk
                continue
            _finish(sel, children, child, out)
        for child in [c for c in children.values() if c.deadline <= time.monotonic()]:
            os.kill(child.pid, signal.SIGKILL)
            _finish(sel, children, child, out)


def _finish(
    sel: selectors.BaseSelector, children: dict[int, _Child], child: _Child, out: int
) -> None:
    sel.unregister(child.fd)
    os.close(child.fd)
    del children[child.fd]
    _, status = os.waitpid(child.pid, 0)
    data = bytes(child.data)
    if _whole_reply(data):
        _write_all(out, data)  # the child's own reply, framed already
    else:
        _write_all(out, _frame(_refusal(child, status)))


def _whole_reply(data: bytes) -> bool:
    """Whether ``data`` is exactly one message and its payload (a child's whole reply)."""
    if len(data) < _LEN:
        return False
    end = _LEN + int.from_bytes(data[:_LEN], "big")
    if len(data) < end:
        return False
    try:
        head = json.loads(data[_LEN:end])
        return isinstance(head, dict) and len(data) == end + int(head.get("payload", 0))
    except (ValueError, TypeError):
        return False


if __name__ == "__main__":
    main()
