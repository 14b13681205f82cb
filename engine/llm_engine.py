"""The engine core: ``step()`` = schedule → run the model → sample → post-process.

Synchronous and single-threaded; ``AsyncLLMEngine`` drives it from a background thread and
``LLM`` drives it directly for offline generation.
"""

from __future__ import annotations

import gc
import logging
import random

import torch

from engine.async_scheduling import can_defer
from engine.client import GenerateRequest
from engine.config import EngineConfig
from engine.core.outputs import RequestOutput, TokenLogprob
from engine.core.request import RemoteKV, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledRequest
from engine.engine_parts import build_engine_parts
from engine.engine_reports import EngineReports
from engine.kv_serving import KVServing
from engine.lora.manager import SLOT_TIMEOUT_ERROR
from engine.lora_serving import bind_lora
from engine.sampling import prompt_logprobs
from engine.sampling.prompt_logprobs import wants_prompt_rows
from engine.sampling.sampler import SampledToken
from kv_store.base import KVConnector

logger = logging.getLogger(__name__)


class LLMEngine(EngineReports, KVServing):
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
        self._seed_rng = random.Random(config.seed)
        self._pending: list[RequestOutput] = []
        self.num_steps = 0
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
        request_id, prompt_token_ids, params = new.request_id, new.prompt_token_ids, new.params
        output_token_ids, remote_kv, save_kv = new.output_token_ids, new.remote_kv, new.save_kv
        priority = new.priority
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.limits.check(prompt_token_ids, output_token_ids or [], params, remote_kv, save_kv)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            priority,
            output_token_ids=list(output_token_ids or []),
            remote_kv=remote_kv,
            save_kv=save_kv,
            num_initial_output_tokens=len(output_token_ids or []),
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
            self._route(request)

    def _route(self, request: Request) -> None:
        if request.remote_kv is None:
            self.scheduler.add_request(request)
        else:
            assert self.transfers is not None
            self.scheduler.register(request)
            self.transfers.add_remote(request)

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
        self.outputs.release(request_id)
        self._release_extras(request_id)
        self._pending.append(self.outputs.output(request, [], "", finished=True))
        return True

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self.transfers and self.transfers.has_work())
            or bool(self._pending)
            or bool(self.pipeline and self.pipeline.deferred)
            or bool(self.batches)
            or self.guided.has_pending()
        )

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs. ``ExecutorFailure`` (the engine is dead for good) when the
        executor lost a tensor-parallel rank while a step ran: its outputs are dropped,
        they may come from wrong logits."""
        outputs = self._step()
        self.executor.check()
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.guided.has_pending():
            outputs += self._admit_guided()
        if self.transfers is not None:
            outputs += self._handle_transfers()
        for late in self.lora.expired(self.scheduler) if self.lora is not None else ():
            outputs.append(self._fail(late, SLOT_TIMEOUT_ERROR))
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        if self.pipeline is not None and self.pipeline.deferred is not None:
            return outputs + self._finish_deferred()
        if self.batches is not None:
            self.num_steps += self.batches.launch()
            done = self.batches.finish_oldest()
            return outputs + (self._postprocess(*done) if done else self._idle())
        sched = self.scheduler.schedule()
        if sched.scheduled:
            logits = self.executor.execute(sched.scheduled)
            self.num_steps += 1
            if self.pipeline is not None and can_defer(sched.scheduled):
                self.pipeline.defer(sched.scheduled, logits)
                outputs += self._finish_deferred()
            else:
                outputs += self._postprocess(sched.scheduled, logits)
        else:
            outputs += self._idle()
        return outputs

    def _idle(self) -> list[RequestOutput]:
        if self.guided.has_pending() and not self.scheduler.has_work():
            self.guided.wait(0.005)  # only grammars compiling: wait briefly instead of spinning
        return []

    def _finish_deferred(self) -> list[RequestOutput]:
        """Launch the step after the deferred one when possible (async scheduling), then
        turn the deferred one's tokens into outputs while the GPU runs the next."""
        assert self.pipeline is not None
        step, launched = self.pipeline.advance()
        self.num_steps += launched
        return [
            self._sampled_output(s.request, tok)
            for s, tok in zip(step.scheduled, step.tokens.result(), strict=True)
            if not s.request.is_finished  # finished at the step before, or aborted since
        ]

    def _sampled_output(self, request: Request, tok: SampledToken) -> RequestOutput:
        """Append one sampled token to its request and say so (text, logprob, finish)."""
        text, status = self.outputs.accept_token(request, tok.token_id)
        logprobs = [tok.logprob] if tok.logprob is not None else None
        out = self._token_output(request, [tok.token_id], text, logprobs, status)
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True  # with the first sampled token, once
            out.prompt_logprobs = list(request.prompt_logprobs)
        return out

    def _admit_guided(self) -> list[RequestOutput]:
        """Route requests whose grammar is ready; fail those it cannot serve."""
        ready, failed = self.guided.poll()
        for request in ready:
            self._route(request)
        return [self._fail(failure.request, failure.error) for failure in failed]

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """Finish a request the engine cannot serve; its output carries ``error``."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.outputs.release(request.request_id)
        self._release_extras(request.request_id)
        out = self.outputs.output(request, [], "", finished=True)
        out.error = error
        return out

    def _postprocess(
        self, scheduled: list[ScheduledRequest], logits: torch.Tensor
    ) -> list[RequestOutput]:
        """``logits`` has one row per request, ``1 + drafts`` rows for one with drafts, or
        one per position of a prompt chunk whose prompt logprobs are wanted."""
        rows, to_sample, to_verify, row = [], [], [], 0
        for s in scheduled:
            n_spec = len(s.spec_token_ids)
            prompt_rows = wants_prompt_rows(s.request)
            n_rows = s.num_new_tokens if prompt_rows else 1 + n_spec
            if s.request.is_finished:  # aborted while its batch was in flight (pp_batches.py)
                row += n_rows
                continue
            if prompt_rows:
                prompt_logprobs.record(
                    s.request, s.request.num_computed_tokens, logits[row : row + n_rows]
                )
            s.request.num_computed_tokens += s.num_new_tokens - n_spec  # drafts count once accepted
            if s.request.num_computed_tokens == s.request.num_tokens:
                if n_spec:
                    to_verify.append((s, logits[row : row + 1 + n_spec]))
                else:
                    rows.append(row + n_rows - 1)
                    to_sample.append(s.request)
            row += n_rows
        outputs = []
        if to_sample:
            # Every row sampled (no drafts, no partial prefill): skip the gather's copy.
            sample_logits = logits if len(rows) == logits.shape[0] else logits[rows]
            sampled = self.sampler(sample_logits, to_sample)
            outputs += [self._sampled_output(r, t) for r, t in zip(to_sample, sampled, strict=True)]
        for s, verify_rows in to_verify:
            outputs.append(self._verify(s, verify_rows))
        return outputs

    def _verify(self, s: ScheduledRequest, rows: torch.Tensor) -> RequestOutput:
        """Speculative step of one request: accept a prefix of its drafts plus one token."""
        assert self.spec is not None
        request, tokens, texts = s.request, [], []
        logprobs: list[TokenLogprob] = []
        status: list[RequestStatus | None] = [None]

        def emit(token: int, logprob: TokenLogprob | None) -> bool:
            text, status[0] = self.outputs.accept_token(request, token)
            tokens.append(token)
            texts.append(text)
            if logprob is not None:
                logprobs.append(logprob)
            return status[0] is not None

        emitted = self.spec.verify(self.sampler, request, rows, s.spec_token_ids, emit)
        # KV is valid for the pending token and the accepted drafts, not for rejected ones.
        request.num_computed_tokens += emitted - 1
        return self._token_output(request, tokens, "".join(texts), logprobs or None, status[0])

    def _token_output(
        self,
        request: Request,
        tokens: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        finished_status: RequestStatus | None,
    ) -> RequestOutput:
        if finished_status is not None:
            self._finish(request, finished_status)
        out = self.outputs.output(
            request, tokens, text, finished=finished_status is not None and not request.save_kv
        )
        out.logprobs = logprobs
        return out

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.outputs.release(request.request_id)
        self._release_extras(request.request_id)
        if request.save_kv and self.transfers is not None:
            self.scheduler.finish(request, status, keep_blocks=True)
            self.transfers.start_save(request)
        else:
            self.scheduler.finish(request, status)

    def _release_extras(self, request_id: str) -> None:
        """Drop a finished request's grammar matcher and draft-model state."""
        self.guided.release(request_id)
        if self.spec is not None:
            self.spec.release(request_id)

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
