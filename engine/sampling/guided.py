"""Guided decoding with xgrammar: compilation in a separate process, a cache, one matcher
per request.

Contract with the engine (``LLMEngine``):
- ``submit(request)`` at ``add_request``: parses the guide now (a bad schema, regex or
  grammar raises ValueError with the parser's message) and sends the token-level compile
  to the grammar helper process (``engine/sampling/grammar_worker.py``), so the step loop
  never waits for a compile and a compile's CPU and memory are never the engine's.
- ``poll()`` each step: requests whose grammar is ready, their matcher advanced through
  any tokens generated elsewhere (the first token from prefill, or a resume), go back to
  the engine to be scheduled; a request whose given tokens the grammar rejects fails.
- While a request runs, its logits processor masks every token the grammar does not allow
  to -inf, and ``accept(request_id, token)`` advances the matcher with each sampled token;
  it returns True when the matcher has terminated (the request then stops, reason "stop").
- ``release(request_id)`` when the request finishes or aborts.

Compiled grammars are cached by ``(kind, value)`` (LRU, ``cache_size`` entries); a second
request with the same guide shares the in-flight compile. With ``share_dir``
(``--guided-cache-dir``) a compile is also left for the other instances of the deployment,
and one another instance left is loaded instead of compiled (``grammar_share.py``): the
prefill and the decode of one request compile its guide once.

Budget (docs/guided-and-speculative.md): a guide over ``max_bytes`` is a ValueError at
``submit`` (INVALID_ARGUMENT, a 400 at the router) naming the limit. A compile runs in a
forked child with ``compile_memory`` bytes of address space beyond what it started with
and ``compile_timeout`` seconds (the helper's one-time start is not counted); over either
it is killed or fails, its requests fail with an error naming the limit (``GUIDE_REFUSED``
prefix: the services answer INVALID_ARGUMENT), and the guide is then refused at ``submit``
at once. The child's exit returns all the memory the compile used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.guided_spec import GuidedSpec
from engine.core.request import Request
from engine.sampling.grammar_worker import READY_TIMEOUT_S, CompileRefused, GrammarWorker
from engine.sampling.guide_parse import parse_guide, parser_message

logger = logging.getLogger(__name__)

# Seconds past ``compile_timeout`` before the engine stops waiting for the helper's answer
# (its first start included).
_BACKSTOP_S = READY_TIMEOUT_S + 30.0

# Prefix of a request error that is the guide's fault (the services answer INVALID_ARGUMENT).
GUIDE_REFUSED = "guide refused: "


@dataclass(slots=True)
class GuidedState:
    """One request's matcher; called as the request's logits processor."""

    matcher: Any
    bitmask: torch.Tensor
    vocab_size: int

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(
            logits.unsqueeze(0), self.bitmask.to(logits.device), vocab_size=self.vocab_size
        )
        return logits


@dataclass(slots=True)
class _Pending:
    request: Request
    future: Future[Any]
    spec: GuidedSpec


@dataclass(slots=True)
class GuidedFailure:
    request: Request
    error: str


@dataclass(slots=True)
class GuidedDecoding:
    """Owns the compiler (built on first use), the grammar cache and per-request matchers."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]
    cache_size: int = 256
    max_bytes: int = 256 * 1024
    compile_timeout: float = 20.0
    compile_memory: int = 1 << 30
    share_dir: str = ""  # compiled grammars shared with other instances (grammar_share.py)
    _over_budget: dict[GuidedSpec, str] = field(default_factory=dict)  # guide -> why refused
    _started: dict[GuidedSpec, float] = field(default_factory=dict)  # sent to the helper at
    _worker: GrammarWorker | None = None
    _info: Any = None  # the tokenizer's xgrammar view, built on first use
    _info_lock: threading.Lock = field(default_factory=threading.Lock)
    _cache: OrderedDict[GuidedSpec, Future[Any]] = field(default_factory=OrderedDict)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _states: dict[str, GuidedState] = field(default_factory=dict)

    @classmethod
    def for_engine(
        cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: Any
    ) -> GuidedDecoding:
        """With the budget of an ``EngineConfig`` (``guided_*``)."""
        return cls(
            tokenizer,
            vocab_size,
            stop_token_ids,
            max_bytes=config.guided_max_bytes,
            compile_timeout=config.guided_compile_timeout,
            compile_memory=config.guided_compile_memory,
            share_dir=config.guided_cache_dir,
        )

    # -- compile ----------------------------------------------------------------------------
    def _get_info(self) -> Any:
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            return self._info

    def _get_worker(self) -> GrammarWorker:
        if self._worker is None:
            import xgrammar as xgr

            self._worker = GrammarWorker(
                tokenizer_info=lambda: self._get_info().serialize_json(),
                decode=lambda text: xgr.CompiledGrammar.deserialize_json(text, self._get_info()),
                share_dir=self.share_dir,
            )
        return self._worker

    def _check_budget(self, spec: GuidedSpec) -> None:
        size = len(spec.value.encode())
        if size > self.max_bytes:
            raise ValueError(
                f"guided {spec.kind} is {size} bytes; the limit is {self.max_bytes} "
                "(--guided-max-bytes)"
            )
        if spec in self._over_budget:
            raise ValueError(self._over_budget[spec])

    def _refusal(self, spec: GuidedSpec, reason: str, error: str) -> str:
        """The message of a failed compile; a compile over its budget names the limit."""
        if reason == "timeout":
            return (
                f"guided {spec.kind} did not compile within {self.compile_timeout:g} s "
                "(--guided-compile-timeout)"
            )
        if reason == "memory":
            return (
                f"guided {spec.kind} needs more than {self.compile_memory} bytes to compile "
                "(--guided-compile-memory)"
            )
        return f"grammar compilation failed: {error}"

    def _future_for(self, spec: GuidedSpec) -> Future[Any]:
        self._check_budget(spec)
        future = self._cache.get(spec)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec)
            return future
        parse_guide(spec)  # raises ValueError now, at add_request (the child parses again)
        worker = self._get_worker()
        future = worker.submit(spec.kind, spec.value, self.compile_timeout, self.compile_memory)
        self._started[spec] = time.monotonic()
        self._cache[spec] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    # -- request lifecycle -----------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Start (or join) the compile of the request's guide; ValueError for a bad guide."""
        if self.tokenizer is None:
            raise ValueError("guided decoding needs the model's tokenizer; this model has none")
        spec = request.params.guided
        assert spec is not None
        future = self._future_for(spec)
        self._pending[request.request_id] = _Pending(request, future, spec)

    def compile_counts(self) -> dict[str, int]:
        """Guides compiled here and loaded from the shared directory (``/metrics``)."""
        worker = self._worker
        if worker is None:
            return {"compiled": 0, "shared": 0}
        return {"compiled": worker.compiled, "shared": worker.shared_loads}

    def has_pending(self) -> bool:
        return bool(self._pending)

    def num_pending(self) -> int:
        return len(self._pending)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for any pending compile (only when nothing else runs)."""
        if self._pending:
            wait_futures([p.future for p in self._pending.values()], timeout, "FIRST_COMPLETED")

    def poll(self) -> tuple[list[Request], list[GuidedFailure]]:
        """Requests whose grammar is ready (matcher attached), and those that failed."""
        ready: list[Request] = []
        failed: list[GuidedFailure] = []
        now = time.monotonic()
        for rid, pending in list(self._pending.items()):
            if not pending.future.done():
                started = self._started.get(pending.spec)
                if started is not None and now - started > self.compile_timeout + _BACKSTOP_S:
                    # The helper kills a compile at its budget; this is the backstop should
                    # the helper itself stop answering.
                    del self._pending[rid]
                    failed.append(self._refuse(pending, "timeout", ""))
                continue
            del self._pending[rid]
            exc = pending.future.exception()
            if isinstance(exc, CompileRefused):
                failed.append(self._refuse(pending, exc.reason, str(exc)))
                continue
            error = self._attach(pending)
            if error is None:
                ready.append(pending.request)
            else:
                failed.append(GuidedFailure(pending.request, error))
        return ready, failed

    def _refuse(self, pending: _Pending, reason: str, error: str) -> GuidedFailure:
        spec = pending.spec
        message = self._refusal(spec, reason, error)
        self._cache.pop(spec, None)
        self._started.pop(spec, None)
        if reason in ("timeout", "memory"):  # over budget: refused at submit from now on
            self._over_budget[spec] = message
        return GuidedFailure(pending.request, GUIDE_REFUSED + message)

    def _attach(self, pending: _Pending) -> str | None:
        import xgrammar as xgr

        request = pending.request
        exc = pending.future.exception()
        if exc is not None:
            return f"{GUIDE_REFUSED}grammar compilation failed: {parser_message(exc)}"
        self._started.pop(pending.spec, None)
        matcher = xgr.GrammarMatcher(pending.future.result())
        for token in request.output_token_ids:
            if not matcher.accept_token(token):
                return (
                    f"{GUIDE_REFUSED}token {token} generated before this request is not "
                    "allowed by its guide"
                )
        state = GuidedState(
            matcher, xgr.allocate_token_bitmask(1, self.vocab_size), self.vocab_size
        )
        self._states[request.request_id] = state
        request.logits_processors.append(state)
        return None

    def is_guided(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._pending

    def accept(self, request_id: str, token_ids: Iterable[int]) -> bool:
        """Advance the matcher; True when it has terminated (or rejects: stop rather than
        emit text outside the grammar)."""
        state = self._states.get(request_id)
        if state is None:
            return False
        for token in token_ids:
            if not state.matcher.accept_token(token):
                logger.warning(
                    "request %s: sampled token %d rejected by its grammar", request_id, token
                )
                return True
        return bool(state.matcher.is_terminated())

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._states.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the grammar helper (it also exits when this process does)."""
        if self._worker is not None:
            self._worker.shutdown()
