"""Auto mode: per request, estimate the cost of remote vs local prefill and pick the cheaper.

Both estimates measure "how long until the decode instance can generate token 2":

* remote = prefill queue + prefill compute of the tokens the prefill instance lacks + RPC
  overhead + loading the prompt KV the decode instance lacks over the store;
* local  = decode queue + compute of the tokens the decode instance lacks, slowed by the
  decode batch it interrupts (a local prefill stalls every running stream).

Rates are learned online (EWMA) from the phase timings the services report: prefill
tokens/s from ``compute_s``, KV bytes/s from ``kv_save_s`` / ``kv_load_s``. Queue depth and
running batch come from live ``GetLoad``; prefix hits from the router's prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean that starts from a prior."""

    value: float
    alpha: float = 0.2

    def update(self, sample: float) -> None:
        self.value += self.alpha * (sample - self.value)


@dataclass(frozen=True, slots=True)
class SideLoad:
    """What the estimator needs to know about one candidate instance."""

    waiting: int
    running: int
    cached_blocks: int  # leading prompt blocks the instance is believed to hold


@dataclass(frozen=True, slots=True)
class Estimate:
    remote_s: float
    local_s: float

    @property
    def decision(self) -> str:
        """``remote_prefill`` or ``local_prefill`` (ties go local: no transfer at all)."""
        return "remote_prefill" if self.remote_s < self.local_s else "local_prefill"


class AutoEstimator:
    """Learned rates + the cost model above. Not thread-safe (event loop only)."""

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float = 4000.0,
        kv_bytes_per_s: float = 1e9,
        rpc_overhead_s: float = 0.002,
        interference: float = 0.05,
        min_samples_s: float = 1e-4,
    ) -> None:
        if prefill_tokens_per_s <= 0 or kv_bytes_per_s <= 0:
            raise ValueError("prior rates must be > 0")
        self.prefill_rate = Ewma(prefill_tokens_per_s)
        self.kv_bandwidth = Ewma(kv_bytes_per_s)
        self.request_prefill_s = Ewma(0.0)
        self.rpc_overhead_s = rpc_overhead_s
        self.interference = interference
        self._min_s = min_samples_s

    def observe_prefill(self, computed_tokens: int, compute_s: float) -> None:
        """A prefill computed ``computed_tokens`` (prompt minus cache hits) in ``compute_s``."""
        if computed_tokens > 0 and compute_s > self._min_s:
            self.prefill_rate.update(computed_tokens / compute_s)
            self.request_prefill_s.update(compute_s)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` of KV were saved or loaded in ``seconds``."""
        if nbytes > 0 and seconds > self._min_s:
            self.kv_bandwidth.update(nbytes / seconds)

    def estimate(
        self,
        *,
        prompt_tokens: int,
        block_size: int,
        kv_bytes_per_token: int,
        prefill: SideLoad | None,
        decode: SideLoad,
    ) -> Estimate:
        """Costs of both placements; ``prefill`` None (no healthy prefill instance) → remote
        is infinitely expensive."""
        rate = max(self.prefill_rate.value, 1.0)
        per_request = max(self.request_prefill_s.value, prompt_tokens / rate)
        local_missing = max(0, prompt_tokens - decode.cached_blocks * block_size)
        local = decode.waiting * per_request + (local_missing / rate) * (
            1.0 + self.interference * decode.running
        )
        if prefill is None:
            return Estimate(float("inf"), local)
        remote_missing = max(0, prompt_tokens - prefill.cached_blocks * block_size)
        queue = (prefill.waiting + 0.5 * prefill.running) * per_request
        transfer = local_missing * kv_bytes_per_token / max(self.kv_bandwidth.value, 1.0)
        remote = queue + remote_missing / rate + self.rpc_overhead_s + transfer
        return Estimate(remote, local)
