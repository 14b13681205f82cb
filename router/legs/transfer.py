"""One request's prompt-KV handoff, as the router sees it (docs/design.md §3 "Tracing").

The prefill's ``kv_committed`` event tells the save (seconds, the handle's blocks and
connector), the decode's first chunk the load (seconds, blocks loaded and recomputed).
Each lands in the request's ``Trace.transfer`` (``usage.pdserve_timings`` shows it as
``kv_*``), in the metrics by connector, in the auto estimator, and — tracing on — in the
``kv.transfer`` span.
"""

from __future__ import annotations

import time
from typing import Any

from router.legs.rpc import LegContext
from router.legs.trace import Trace


def note_save(leg: LegContext, trace: Trace, handle: Any, seconds: float) -> None:
    """The prefill committed the prompt's KV (``handle``) after ``seconds`` of saving."""
    leg.kv_dtype = handle.dtype or leg.kv_dtype
    connector = handle.connector or "unknown"
    # Upper bound: the prefill skips blocks the store already held.
    nbytes = handle.num_tokens * leg.shape.kv_bytes_per_token(handle.dtype)
    leg.metrics.kv_bytes.labels(connector, "save").inc(nbytes)
    leg.metrics.kv_transfer_seconds.labels(connector, "save").observe(max(seconds, 0.0))
    leg.metrics.kv_transfer_blocks.labels(connector, "save").inc(len(handle.block_keys))
    leg.estimator.observe_transfer(nbytes, seconds)
    # The save starts when the first token is sampled: that is when the transfer began.
    started = time.perf_counter() - max(seconds, 0.0)
    trace.transfer.update(
        connector=connector,
        blocks=len(handle.block_keys),
        tokens=handle.num_tokens,
        bytes_saved=nbytes,
        save_s=round(seconds, 6),
        started_at=started,
    )


def note_load(
    leg: LegContext, trace: Trace, handle: Any, timings: Any, call_started: float
) -> None:
    """The decode's first chunk reported loading ``timings.kv_blocks_loaded`` blocks of
    ``handle``; ``call_started``: the ``perf_counter`` when its Decode call began."""
    connector = handle.connector or "unknown"
    if timings.kv_blocks_recomputed:
        leg.metrics.kv_load_fallbacks.labels("recompute").inc()
    tokens = min(handle.num_tokens, timings.kv_blocks_loaded * max(handle.block_size, 1))
    # The decode's own count when it reports one (a re-cut load reads more than it keeps).
    nbytes = timings.kv_bytes_loaded or tokens * leg.shape.kv_bytes_per_token(handle.dtype)
    leg.metrics.kv_transfer_seconds.labels(connector, "load").observe(max(timings.kv_load_s, 0.0))
    leg.metrics.kv_transfer_blocks.labels(connector, "load").inc(timings.kv_blocks_loaded)
    # Delta handoffs: the blocks the decode already held were not moved.
    leg.metrics.kv_transfer_blocks.labels(connector, "on_decode").inc(timings.kv_blocks_local)
    if nbytes:
        leg.metrics.kv_bytes.labels(connector, "load").inc(nbytes)
        leg.estimator.observe_transfer(nbytes, timings.kv_load_s)
    figures = trace.transfer
    figures.setdefault("connector", connector)
    figures.update(
        blocks_loaded=timings.kv_blocks_loaded,
        blocks_on_decode=timings.kv_blocks_local,
        blocks_recomputed=timings.kv_blocks_recomputed,
        bytes_loaded=nbytes,
        load_s=round(timings.kv_load_s, 6),
    )
    if trace.spans is None:
        return
    started = figures.get("started_at", call_started)
    # The load ends after the decode's queue wait and the load itself (service clock
    # differences aside, this is when it finished as seen from here).
    ended = call_started + timings.queue_s + timings.kv_load_s
    attrs = {k: v for k, v in figures.items() if k != "started_at"}
    trace.spans.transfer(started, max(ended, started), attrs)
