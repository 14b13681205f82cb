"""Per-request bookkeeping: what a request is, the deltas it yields, and its timings.

A :class:`Job` is the validated, tokenized request the orchestrator runs; a
:class:`Trace` collects its phase timings and token timestamps and turns them into
metrics once, when the request ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.legs.params import GenParams
from router.legs.spans import RequestSpans
from router.metrics import PHASES, RouterMetrics
from router.routing.policies import RouteNote


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Delta:
    """New output of one choice: tokens, their text, optional logprobs, and the finish."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first delta, if asked


@dataclass(slots=True)
class Job:
    """A request ready to run: prompt ids, their block hashes, sampling, and its deadline."""

    request_id: str
    prompt_ids: list[int]
    block_hashes: list[bytes]
    params: GenParams
    max_tokens: int
    n: int = 1
    user: str | None = None
    deadline: float = float("inf")  # time.monotonic() by which the request must be done
    lora_name: str | None = None  # the LoRA adapter ``model`` named (None: the base model)
    # Placement chose this decode instance (decode-first, auto mode's local pick); the
    # choices' first ``Decode`` goes there while it is healthy (router/legs/placement.py).
    decode_pin: str | None = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


# The per-request transfer figures ``pdserve_timings`` carries as ``kv_<name>``.
# ``blocks_on_decode``: prompt blocks the decode held already (its prefix cache), which
# the handoff did not move (docs/design.md §3 "Delta handoffs").
TRANSFER_FIGURES = (
    "blocks_loaded", "blocks_on_decode", "blocks_recomputed", "bytes_saved", "bytes_loaded"
)  # fmt: skip


# The placements that compute the prompt on a decode instance (``prefill_path`` "local";
# router/legs/placement.py); every other one computes it on a prefill instance.
LOCAL_DECISIONS = ("local_prefill", "decode_first", "local_suffix")


@dataclass(slots=True)
class Trace:
    """Timings of one request; ``finish`` records them into the metrics once."""

    arrival: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    itl_samples: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_instance: str | None = None
    decode_instances: list[str] = field(default_factory=list)
    decision: str | None = None
    # How the request was placed and routed (docs/router.md "Routing on held blocks"):
    # the placement's inputs (auto's estimate, the decode-first holder) and every
    # instance choice with its reason and prefix hit. ``pdserve_timings`` returns it.
    placement: dict[str, Any] = field(default_factory=dict)
    routes: list[dict[str, Any]] = field(default_factory=list)
    # The prompt's KV handoff (router/legs/transfer.py): connector, blocks, bytes, seconds.
    transfer: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    # Prompt tokens the instances that computed the prompts (the prefill, or the decode on
    # a local path) served from their own cache, summed over the request's prompts: the
    # rest they computed. None until known.
    prompt_cached: int | None = None
    spans: RequestSpans | None = None  # only when tracing is on (router/legs/spans.py)
    _done: bool = False

    def note_route(
        self, pool: str, instance: str, note: RouteNote | None, blocks: int
    ) -> dict[str, Any]:
        """Record one instance choice: the pool, the instance and why (``RouteNote``)."""
        entry: dict[str, Any] = {"pool": pool, "instance": instance, "prompt_blocks": blocks}
        if note is not None:
            entry["reason"] = note.reason
            if note.match is not None:
                entry.update(note.match.as_dict())
            if note.score is not None:
                entry["score"] = round(note.score, 3)
        self.routes.append(entry)
        return entry

    def route_info(self) -> dict[str, Any]:
        """The ``pdserve_route`` usage field: decision, placement inputs, choices."""
        info = {"decision": self.decision, **self.placement, "choices": self.routes}
        if "connector" in self.transfer:
            info["kv_connector"] = self.transfer["connector"]
        return info

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    def on_delta(self, delta: Delta) -> None:
        now = time.perf_counter()
        count = len(delta.token_ids)
        self.completion_tokens += count
        if count == 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            if self.spans is not None:
                self.spans.first_token(now - self.arrival)
        prev = self.last_token_at.get(delta.index)
        if prev is not None:
            self.itl_samples.append((now - prev) / count)
        self.last_token_at[delta.index] = now

    def prefill_path(self) -> str | None:
        """``local`` (a decode instance computed the prompt) or ``remote`` (a prefill did)."""
        if self.decision is None:
            return None
        return "local" if self.decision in LOCAL_DECISIONS else "remote"

    def prompt_computed(self) -> int | None:
        """Prompt tokens computed (where ``prefill_path`` says); None until known."""
        if self.prompt_cached is None:
            return None
        return max(0, self.prompt_tokens - self.prompt_cached)

    def timings(self) -> dict[str, float | str]:
        """Phase → seconds, plus ttft and e2e so far (the ``pdserve_timings`` usage field),
        the handoff's figures, and where the prompt was computed (``prefill_path``,
        ``prompt_tokens_computed`` there, ``prompt_tokens_cached`` there)."""
        out: dict[str, float | str] = {
            name: round(self.phases.get(name, 0.0), 6) for name in PHASES
        }
        if self.first_token_at is not None:
            out["ttft"] = round(self.first_token_at - self.arrival, 6)
        out["e2e"] = round(time.perf_counter() - self.arrival, 6)
        for key in TRANSFER_FIGURES:
            if key in self.transfer:
                out[f"kv_{key}"] = self.transfer[key]
        path, computed = self.prefill_path(), self.prompt_computed()
        if path is not None:
            out["prefill_path"] = path
        if computed is not None:
            out["prompt_tokens_computed"] = computed
            out["prompt_tokens_cached"] = self.prompt_tokens - computed
        return out

    def finish(self, metrics: RouterMetrics, outcome: str) -> None:
        """Record the request's outcome and, for successes, its latencies (idempotent)."""
        if self._done:
            return
        self._done = True
        metrics.requests.labels(outcome).inc()
        if self.spans is not None:
            self.spans.finish(outcome, self._usage_attributes())
        if outcome != "success":
            return
        end = time.perf_counter()
        metrics.e2e.observe(end - self.arrival)
        for name, seconds in self.phases.items():
            metrics.observe_phase(name, seconds)
        if self.first_token_at is not None:
            metrics.ttft.observe(self.first_token_at - self.arrival)
            if self.completion_tokens > 1:
                metrics.tpot.observe((end - self.first_token_at) / (self.completion_tokens - 1))
        for sample in self.itl_samples:
            metrics.itl.observe(sample)
        path, computed = self.prefill_path(), self.prompt_computed()
        if path is not None and computed is not None:
            metrics.prompt_tokens_computed.labels(path).inc(computed)

    def _usage_attributes(self) -> dict[str, Any]:
        """The root span's closing attributes (GenAI semantic conventions where they exist)."""
        return {
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "pdserve.cached_tokens": self.cached_tokens,
            "pdserve.decision": self.decision,
            "pdserve.prefill_path": self.prefill_path(),
            "pdserve.prompt_tokens_computed": self.prompt_computed(),
            "pdserve.prefill_instance": self.prefill_instance,
            "pdserve.decode_instances": list(self.decode_instances) or None,
        }
