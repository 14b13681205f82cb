"""Where a request's prompt is computed (docs/design.md §1, §5): remote prefill, local prefill
on a decode instance, decode-first, or the decode computing a short missing suffix.

- ``disaggregated``: remote prefill, unless a decode instance already holds the whole
  prompt (every full block, in device or host memory, by its live KV events): then the
  request goes to that decode instance without a prefill (``decode_first``); no KV moves.
  Conditional disaggregation: a decode instance that holds a prefix of the prompt and
  lacks at most ``max_local_prefill_tokens`` of it computes that suffix itself
  (``local_suffix``): a remote prefill would compute the whole prompt (unless the prefill
  holds the prefix too) and move it, to save the decode a short chunk of work.
- ``colocated``: local prefill, always.
- ``auto``: decode-first as above; otherwise the estimator (``router/routing/estimator.py``)
  prices local prefill on each healthy decode instance with that instance's real hit
  length (the event index, else the guessing index) and remote prefill on the prefill
  pool; local wins → the request is pinned to the decode instance it was priced on.

Every decision is counted in ``pdserve_disagg_decisions_total{decision}`` and written to
the request's trace (with the estimate and the decode-first holder).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.legs.rpc import LegContext
from router.legs.trace import Job, Trace
from router.lora import lora_candidates
from router.routing.estimator import Estimate, SideLoad
from router.routing.kv_index import Match
from router.routing.pool import Instance, InstancePool

MODES = ("disaggregated", "colocated", "auto")


class Placement:
    """Decides each request's placement; one per app (event loop only)."""

    def __init__(
        self,
        leg: LegContext,
        mode: str,
        *,
        decode_first: bool = True,
        max_local_prefill_tokens: int = 256,
        skew_ratio: float = 2.0,
        skew_slack: float = 8.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.leg = leg
        self.mode = mode
        if max_local_prefill_tokens < 0:
            raise ValueError(
                f"max_local_prefill_tokens must be >= 0, got {max_local_prefill_tokens}"
            )
        self.decode_first = decode_first
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.skew_ratio = skew_ratio
        self.skew_slack = skew_slack

    def decide(self, job: Job, trace: Trace) -> str:
        """``remote_prefill``, ``local_prefill``, ``decode_first`` or ``local_suffix``
        (counted in metrics).

        Remote prefill needs both pools; with either one empty of healthy instances the
        request runs in one ``Decode`` call on whichever pool has one (a decode instance
        prefills itself; with no decode, ``decode_deltas`` puts it on a prefill instance)."""
        decision = "local_prefill" if self.mode == "colocated" else "remote_prefill"
        if decision == "remote_prefill" and self.decode_first:
            held = self._decode_holder(job, trace)
            if held is not None:
                job.decode_pin, decision = held
        if decision == "remote_prefill" and self.mode == "auto":
            decision = self._auto(job, trace)
        if decision == "remote_prefill" and not self.leg.prefill_pool.healthy():
            self.leg.metrics.pool_fallbacks.labels("no_prefill").inc()
            decision = "local_prefill"
        elif decision == "remote_prefill" and not self.leg.decode_pool.healthy():
            decision = "local_prefill"  # counted as no_decode where the instance is picked
        self.leg.metrics.disagg_decisions.labels(decision).inc()
        return decision

    def _candidates(self, pool: InstancePool, job: Job) -> Sequence[Instance]:
        candidates: Sequence[Instance] = pool.healthy()
        if job.lora_name is not None:
            candidates = lora_candidates(candidates, job.lora_name)
        return candidates

    def _decode_holder(self, job: Job, trace: Trace) -> tuple[str, str] | None:
        """(instance, decision) of the decode instance that should compute the prompt's
        rest itself, by its live KV events (device or host memory): one that holds every
        full block (``decode_first``), else one whose held prefix leaves at most
        ``max_local_prefill_tokens`` tokens to compute (``local_suffix``); the fewest
        missing tokens win, then the least load. None if none qualifies, or it is much
        busier than the least loaded decode instance."""
        pool = self.leg.decode_pool
        if not job.block_hashes:
            return None
        candidates = self._candidates(pool, job)
        live = [inst for inst in candidates if pool.events_live(inst.url)]
        if not live:
            return None
        matches = pool.kv_index.match([inst.url for inst in live], job.block_hashes)
        whole = len(job.block_hashes)
        held = {inst.url: _held_blocks(matches[inst.url], whole) for inst in live}
        missing = {
            url: max(0, len(job.prompt_ids) - k * self.leg.block_size) for url, k in held.items()
        }
        eligible = [
            inst
            for inst in live
            if held[inst.url] == whole
            or (held[inst.url] > 0 and missing[inst.url] <= self.max_local_prefill_tokens)
        ]
        if not eligible:
            return None
        holder = min(eligible, key=lambda inst: (missing[inst.url], inst.load_score(), inst.url))
        least = min(candidates, key=lambda inst: (inst.load_score(), inst.url))
        decision = "decode_first" if held[holder.url] == whole else "local_suffix"
        if holder.load_score() > least.load_score() * self.skew_ratio + self.skew_slack:
            trace.placement[f"{decision}_skipped"] = holder.url
            return None
        trace.placement[decision] = {
            "instance": holder.url,
            **matches[holder.url].as_dict(),
            "missing_tokens": missing[holder.url],
        }
        return holder.url, decision

    def _auto(self, job: Job, trace: Trace) -> str:
        """Price local prefill on each decode instance (its own hit length) against remote
        prefill; pin the request to the decode instance when local wins."""
        est, url, hit = self.estimate(job)
        trace.placement["estimate"] = {
            "remote_s": round(est.remote_s, 6),
            "local_s": round(est.local_s, 6),
            "decode": url,
            "decode_hit_blocks": hit,
        }
        if est.decision == "local_prefill" and url is not None:
            job.decode_pin = url
        return est.decision

    def estimate(self, job: Job) -> tuple[Estimate, str | None, int]:
        """The cheapest local placement (and its decode instance and hit blocks) against
        remote prefill on the prefill pool. The prefill side is priced on its least loaded
        instance and its best prefix match, without calling the policies (round robin
        would advance)."""
        shape = self.leg.shape
        hashes = job.block_hashes
        prefill = self._candidates(self.leg.prefill_pool, job)
        prefill_side = None
        if prefill:
            least = min(prefill, key=lambda inst: (inst.load_score(), inst.url))
            hits = self.leg.prefill_pool.matcher.matches([i.url for i in prefill], hashes)
            cached = max(m.fast_blocks for m in hits.values())
            prefill_side = SideLoad(least.load.waiting, least.load.running, cached)
        decode = self._candidates(self.leg.decode_pool, job)
        matches = self.leg.decode_pool.matcher.matches([i.url for i in decode], hashes)
        best: tuple[Estimate, str | None, int] | None = None
        for inst in sorted(decode, key=lambda i: (i.load_score(), i.url)):
            hit = matches[inst.url].fast_blocks
            est = self.leg.estimator.estimate(
                prompt_tokens=len(job.prompt_ids),
                block_size=self.leg.block_size,
                kv_bytes_per_token=shape.kv_bytes_per_token(self.leg.kv_dtype),
                prefill=prefill_side,
                decode=SideLoad(inst.load.waiting, inst.load.running, hit),
            )
            if best is None or est.local_s < best[0].local_s:
                best = (est, inst.url, hit)
        if best is not None:
            return best
        empty = SideLoad(0, 0, 0)
        est = self.leg.estimator.estimate(
            prompt_tokens=len(job.prompt_ids),
            block_size=self.leg.block_size,
            kv_bytes_per_token=shape.kv_bytes_per_token(self.leg.kv_dtype),
            prefill=prefill_side,
            decode=empty,
        )
        return est, None, 0


def _held_blocks(match: Match, whole: int) -> int:
    """Leading prompt blocks an instance reuses without the store: every block when it
    holds all ``whole`` in device or host memory; else its fast blocks, unless a store-only
    block sits inside the leading run (then the fast ones need not be leading: count none,
    the suffix is not known to be short)."""
    if match.fast_blocks == whole or match.store == 0:
        return match.fast_blocks
    return 0
