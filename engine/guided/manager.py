"""Guided decoding with xgrammar: asynchronous compilation, a cache, one matcher per request.

Contract with the engine (``LLMEngine``):
- ``submit(request)`` at ``add_request``: parses the guide now (a bad schema, regex or
  grammar raises ValueError with the parser's message — parsing takes well under a
  millisecond) and compiles the token-level grammar on a small thread pool (tens of ms
  for SmolLM2's 49k vocabulary), so the step loop never waits for a compile.
- ``poll()`` each step: requests whose grammar is ready, their matcher advanced through
  any tokens generated elsewhere (the first token from prefill, or a resume), go back to
  the engine to be scheduled; a request whose given tokens the grammar rejects fails.
- While a request runs, its logits processor masks every token the grammar does not allow
  to -inf, and ``accept(request_id, token)`` advances the matcher with each sampled token;
  it returns True when the matcher has terminated (the request then stops, reason "stop").
- ``release(request_id)`` when the request finishes or aborts.

Compiled grammars are cached by ``(kind, value)`` (LRU, ``cache_size`` entries); a second
request with the same guide shares the in-flight compile.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.guided.spec import GuidedSpec
from engine.request import Request

logger = logging.getLogger(__name__)

# xgrammar prefixes its C++ errors with a timestamp, a source location and an internal check.
_XGR_NOISE = re.compile(
    r"^\s*\[[0-9:]+\]\s*\S+\.(cc|h):\d+:\s*(Check failed: \(.*?\) is false:\s*)?"
)


def parser_message(exc: BaseException) -> str:
    """xgrammar's error text without the C++ location noise."""
    return _XGR_NOISE.sub("", str(exc)).strip() or type(exc).__name__


def parse_guide(spec: GuidedSpec) -> Any:
    """The xgrammar ``Grammar`` of a guide; ValueError carrying the parser's message."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_object":
            # Any JSON object; additional properties allowed (strict mode would allow only {}).
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.kind == "json_schema":
            # Compact whitespace: free whitespace lets small models loop on spaces forever.
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            # JSON string literals are valid EBNF literals (same escapes).
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in spec.choices())
            )
        return xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid guided {spec.kind}: {parser_message(exc)}") from exc


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
    max_workers: int = 2
    cache_size: int = 256
    _pool: ThreadPoolExecutor | None = None
    _compiler: Any = None
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock)
    _cache: OrderedDict[GuidedSpec, Future[Any]] = field(default_factory=OrderedDict)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _states: dict[str, GuidedState] = field(default_factory=dict)

    # -- compile ----------------------------------------------------------------------------
    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, grammar: Any) -> Any:
        return self._get_compiler().compile_grammar(grammar)

    def _future_for(self, spec: GuidedSpec) -> Future[Any]:
        future = self._cache.get(spec)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec)
            return future
        grammar = parse_guide(spec)  # raises ValueError now, at add_request
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._compile, grammar)
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
        self._pending[request.request_id] = _Pending(request, self._future_for(spec))

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
        for rid, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[rid]
            error = self._attach(pending)
            if error is None:
                ready.append(pending.request)
            else:
                failed.append(GuidedFailure(pending.request, error))
        return ready, failed

    def _attach(self, pending: _Pending) -> str | None:
        import xgrammar as xgr

        request = pending.request
        exc = pending.future.exception()
        if exc is not None:
            return f"grammar compilation failed: {parser_message(exc)}"
        matcher = xgr.GrammarMatcher(pending.future.result())
        for token in request.output_token_ids:
            if not matcher.accept_token(token):
                return f"token {token} generated before this request is not allowed by its guide"
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
