"""The router's Prometheus metrics, on a registry the app owns (no process globals).

Names are a contract (dashboards, the autoscaler): change them only together with those.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("router_queue", "prefill_queue", "prefill_compute", "kv_save", "kv_load", "decode_queue")
OUTCOMES = (
    "success",
    "invalid",
    "unauthorized",
    "not_found",
    "rate_limited",
    "unavailable",
    "cancelled",
    "timeout",
    "error",
)

# Why a prompt's KV was recomputed instead of loaded (``pdserve_kv_load_fallbacks_total``):
# every reason is exported from the start, so the dashboard panel shows 0, not "no data".
KV_FALLBACK_REASONS = ("save_failed", "prefill_lost", "handle_refused", "recompute")

# Why a request left its mode's placement (``pdserve_router_pool_fallback_total``).
FALLBACK_REASONS = ("no_prefill", "prefill_failed", "no_decode")

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_TOKEN_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
)


class RouterMetrics:
    """Every metric the router exports; one instance per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "pdserve_ttft_seconds",
            "Time to first token seen by the client",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_itl_seconds",
            "Inter-token latency between streamed tokens",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_tpot_seconds",
            "Time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "pdserve_phase_seconds",
            "Time spent per request phase",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.kv_bytes = Counter(
            "pdserve_kv_bytes",
            "KV bytes moved through the store, as seen by the router",
            ["connector", "direction"],
            registry=r,
        )
        # Per request, by connector: how long the prompt's KV save / load took, and its
        # blocks (router/legs/transfer.py; save counts every prompt block, load the loaded ones).
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Seconds of one request's KV save (prefill) or load (decode), by connector",
            ["connector", "direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_blocks = Counter(
            "pdserve_kv_transfer_blocks",
            "KV blocks of the requests' handoffs, by connector and direction (save, load, "
            "on_decode: held by the decode already, not moved)",
            ["connector", "direction"],
            registry=r,
        )
        self.kv_load_fallbacks = Counter(
            "pdserve_kv_load_fallbacks",
            "Requests whose prompt KV was recomputed instead of loaded",
            ["reason"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            "pdserve_disagg_decisions", "Prefill placement per request", ["decision"], registry=r
        )
        self.prompt_tokens_computed = Counter(
            "pdserve_prompt_tokens_computed",
            "Prompt tokens computed (not served from a cache), by where: remote (a prefill "
            "instance) or local (a decode instance: colocated, decode-first, local suffix)",
            ["path"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "pdserve_prefill_retries", "Prefill calls retried on another instance", registry=r
        )
        self.decode_failovers = Counter(
            "pdserve_decode_failovers", "Decode streams resumed on another instance", registry=r
        )
        self.decode_stalls = Counter(
            "pdserve_decode_stalls",
            "Decode streams cancelled as hung (health: checks got no answer; idle: no chunk "
            "within --stream-idle-timeout) before resuming elsewhere",
            ["reason"],
            registry=r,
        )
        self.pool_fallbacks = Counter(
            "pdserve_router_pool_fallback",
            "Requests (choices) served by the other pool because the one the mode wants had no "
            "healthy instance or failed (no_prefill, prefill_failed, no_decode; "
            "docs/design.md §5)",
            ["reason"],
            registry=r,
        )
        labels = ["pool", "instance"]
        self.inst_waiting = Gauge(
            "pdserve_instance_waiting",
            "Waiting requests per instance (GetLoad)",
            labels,
            registry=r,
        )
        self.inst_running = Gauge(
            "pdserve_instance_running",
            "Running requests per instance (GetLoad)",
            labels,
            registry=r,
        )
        self.inst_kv_usage = Gauge(
            "pdserve_instance_kv_usage",
            "KV cache usage fraction per instance (GetLoad)",
            labels,
            registry=r,
        )
        self.inst_healthy = Gauge(
            "pdserve_instance_healthy",
            "1 when the instance passes health checks",
            labels,
            registry=r,
        )
        self._add_kv_index_metrics(r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for decision in ("remote_prefill", "local_prefill", "decode_first", "local_suffix"):
            self.disagg_decisions.labels(decision)
        for reason in FALLBACK_REASONS:
            self.pool_fallbacks.labels(reason)
        for path in ("local", "remote"):
            self.prompt_tokens_computed.labels(path)
        for reason in KV_FALLBACK_REASONS:
            self.kv_load_fallbacks.labels(reason)

    def _add_kv_index_metrics(self, r: CollectorRegistry) -> None:
        # The global block index (router/routing/kv_index.py, docs/design.md §5).
        self.kv_index_blocks = Gauge(
            "pdserve_kv_index_blocks",
            "Distinct KV blocks the router's event index knows held, per pool",
            ["pool"],
            registry=r,
        )
        self.kv_index_entries = Gauge(
            "pdserve_kv_index_entries",
            "(block, instance) entries of the event index, per pool (bounded by "
            "--kv-index-max-entries)",
            ["pool"],
            registry=r,
        )
        self.kv_index_counters = {
            what: Counter(f"pdserve_kv_index_{what}", text, ["pool"], registry=r)
            for what, text in (
                ("batches", "KV event batches applied"),
                ("resyncs", "Snapshots applied (each subscription starts with one)"),
                ("gaps", "Sequence gaps seen in a KV event stream (each resubscribes)"),
                ("dropped", "Index entries dropped to keep --kv-index-max-entries"),
            )
        }
        self.kv_events_lag = Gauge(
            "pdserve_kv_index_lag_seconds",
            "Seconds since the instance's last KV event batch (inf: none yet)",
            ["pool", "instance"],
            registry=r,
        )
        self.kv_events_live = Gauge(
            "pdserve_kv_index_live",
            "1 while the instance's KV event stream feeds the index (0: guessing index)",
            ["pool", "instance"],
            registry=r,
        )
        self.route_choices = Counter(
            "pdserve_route_choices",
            "Instances picked per pool and why (prefix_events, prefix_routed, prefix_guess, load, "
            "skewed, policy, pinned)",
            ["pool", "reason"],
            registry=r,
        )

    def kv_index_counter(self, what: str, pool: str, amount: float = 1.0) -> None:
        self.kv_index_counters[what].labels(pool).inc(amount)

    def set_kv_index(self, pool: str, blocks: int, entries: int) -> None:
        self.kv_index_blocks.labels(pool).set(blocks)
        self.kv_index_entries.labels(pool).set(entries)

    def set_kv_feed(self, pool: str, instance: str, *, live: bool, lag_s: float) -> None:
        self.kv_events_live.labels(pool, instance).set(1.0 if live else 0.0)
        self.kv_events_lag.labels(pool, instance).set(lag_s)

    def observe_phase(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self.phase.labels(phase).observe(max(0.0, seconds))

    def set_instance(
        self,
        pool: str,
        instance: str,
        *,
        healthy: bool,
        waiting: int = 0,
        running: int = 0,
        kv_usage: float = 0.0,
    ) -> None:
        self.inst_healthy.labels(pool, instance).set(1.0 if healthy else 0.0)
        self.inst_waiting.labels(pool, instance).set(waiting)
        self.inst_running.labels(pool, instance).set(running)
        self.inst_kv_usage.labels(pool, instance).set(kv_usage)

    def remove_instance(self, pool: str, instance: str) -> None:
        for gauge in (
            self.inst_healthy,
            self.inst_waiting,
            self.inst_running,
            self.inst_kv_usage,
            self.kv_events_lag,
            self.kv_events_live,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(pool, instance)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
