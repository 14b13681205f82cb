"""The engine core: one step = the hooks, then launch and finish a step, then the outputs.

Synchronous and single-threaded; ``AsyncLLMEngine`` drives it from a background thread and
``LLM`` drives it directly for offline generation. How a step is launched and finished
(synchronously, with async scheduling or with batches in flight), the per-step hooks and
the post-processing are collaborators built once (``engine/engine_parts.py``,
``engine/step/``; docs/design.md §3 "The step").
"""

from __future__ import annotations

import gc
import logging
import random

from engine.client import GenerateRequest
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request import RemoteKV, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.engine_parts import build_engine_parts
from engine.engine_reports import EngineReports
from engine.lora_serving import bind_lora
from engine.stats import EngineStats, LoadStats
from engine.step.hooks import route
from kv_store.base import KVConnector

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None) -> None:
        self.config = config
        self.connector = connector
        parts = build_engine_parts(config, connector)  # engine/engine_parts.py: the order
        self.args, self.max_model_len = parts.args, parts.max_model_len
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.executor, self.runner = parts.executor, parts.runner
        self.kv, self.kv_events, self.host_tier = parts.kv, parts.kv_events, parts.host_tier
        self.lora = parts.lora
        self.scheduler, self.sampler, self.guided = parts.scheduler, parts.sampler, parts.guided
        self.spec = parts.spec
        self.model_fingerprint, self.kv_layout = parts.model_fingerprint, parts.kv_layout
        self.transfers = parts.transfers
        self.limits, self.outputs = parts.limits, parts.outputs
        self.pipeline, self.batches = parts.pipeline, parts.batches
        self.post, self.steps, self.hooks = parts.post, parts.steps, parts.hooks
        self.reports = EngineReports(
            self.scheduler, self.guided, self.transfers, self.kv, connector, self.spec,
            self.host_tier,
        )  # fmt: skip
        self._seed_rng = random.Random(config.seed)
        self._pending: list[RequestOutput] = []
        # Move everything built so far (weights' wrappers, ~num_blocks block objects) out of
        # the GC's generations, so collections in the step loop stay short.
        gc.collect()
        gc.freeze()

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_token_ids: list[int] | None = None,
        remote_kv: RemoteKV | None = None,
        save_kv: bool = False,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> None:
        """``add`` with the request's fields spelled out."""
        fields = (request_id, prompt_token_ids, params, output_token_ids, remote_kv, save_kv)
        self.add(GenerateRequest(*fields, priority, lora_name))

    def add(self, new: GenerateRequest) -> None:
        """Queue a request. Raises ValueError (naming the field) for bad input."""
        params, output_token_ids = new.params, list(new.output_token_ids or [])
        if new.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {new.request_id!r} is already in use")
        self.limits.check(
            new.prompt_token_ids, output_token_ids, params, new.remote_kv, new.save_kv
        )
        request = Request(
            new.request_id,
            list(new.prompt_token_ids),
            params,
            self.eos_token_ids,
            new.priority,
            output_token_ids=output_token_ids,
            remote_kv=new.remote_kv,
            save_kv=new.save_kv,
            num_initial_output_tokens=len(output_token_ids),
            effective_seed=params.seed
            if params.seed is not None
            else self._seed_rng.getrandbits(63),
        )
        bind_lora(self.lora, request, new.lora_name)  # LoRAError (a ValueError) if unknown
        if params.guided is not None:
            self.guided.submit(request)  # ValueError for a bad guide; compiles in the background
        self.outputs.start(request)
        if params.guided is not None:
            self.scheduler.register(request)  # routed once its grammar is ready
        else:
            route(self.scheduler, self.transfers, request)

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.is_finished:
            # A finished prefill whose blocks a peer may still pull (p2p): end the hold.
            return self.transfers is not None and self.transfers.release_held(request_id)
        free_now = self.transfers.abort(request) if self.transfers else True
        if free_now:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        else:
            request.status = RequestStatus.FINISHED_ABORTED
        self._pending.append(self.post.ended(request))
        return True

    def take_ended(self) -> list[RequestOutput]:
        """The outputs of requests ended outside a step (aborts), now rather than with the
        next step's."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self._pending)
            or any(hook.has_work() for hook in self.hooks)
            or self.steps.in_flight()
        )

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs: the hooks' (guided admission, KV transfers, LoRA expiry,
        drafts), then what the step runner finished. ``ExecutorFailure`` (the engine is dead
        for good) when the executor lost a tensor-parallel rank while a step ran: its
        outputs are dropped, they may come from wrong logits."""
        outputs, self._pending = self._pending, []
        for hook in self.hooks:
            outputs += hook.before_step()
        finished = self.steps.step()
        if finished is None:  # nothing could run
            self._idle()
        else:
            outputs += finished
        self.executor.check()
        return outputs

    def _idle(self) -> None:
        if self.guided.has_pending() and not self.scheduler.has_work():
            self.guided.wait(0.005)  # only grammars compiling: wait briefly instead of spinning

    @property
    def num_steps(self) -> int:
        """Model steps launched so far."""
        return self.steps.num_steps

    # -- reports and the end --------------------------------------------------------------
    def get_load(self) -> LoadStats:
        return self.reports.get_load()

    def stats(self, load: LoadStats | None = None) -> EngineStats:
        """Load (``load`` if given, else now), connector counters, KV fallbacks and
        speculative counters, as one snapshot."""
        stats = self.reports.stats(load)
        stats.lora = self.lora.metrics() if self.lora is not None else None
        return stats

    def close_kv(self) -> None:
        """Stop the KV connector's workers (on every rank) and release the store."""
        if self.transfers is not None:
            self.transfers.connector.close()

    def shutdown(self) -> None:
        """Stop what the engine runs besides this thread (tensor-parallel workers, the
        grammar helper); idempotent."""
        self.executor.shutdown()
        self.guided.shutdown()
        # What __init__ froze may now be garbage: let the collector see it again.
        gc.unfreeze()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, host tier included (benchmarks: cold prefills)."""
        self.kv.reset_prefix_cache()
