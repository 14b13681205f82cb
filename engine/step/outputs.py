"""A step's logits into ``RequestOutput``s, and the ends of requests (docs/design.md §3
"The step"). Every step runner finishes its steps here, and the hooks fail requests
here, so a request's output, its stop and the release of what it holds have one owner."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.outputs import RequestOutput, TokenLogprob
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledRequest, Scheduler
from engine.sampling import prompt_logprobs
from engine.sampling.prompt_logprobs import wants_prompt_rows
from engine.sampling.sampler import SampledToken, Sampler

if TYPE_CHECKING:
    from engine.kv.transfers import KVTransferCoordinator
    from engine.sampling.guided import GuidedDecoding
    from engine.spec_decode.decoder import SpecDecoder
    from engine.step.async_scheduling import DeferredStep
    from engine.step.output_processor import OutputProcessor


class StepOutputs:
    """Samples (or verifies drafts for) the rows of a finished step and builds outputs."""

    def __init__(
        self,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        sampler: Sampler,
        guided: GuidedDecoding,
        spec: SpecDecoder | None,
        transfers: KVTransferCoordinator | None,
    ) -> None:
        self.scheduler, self.outputs, self.sampler = scheduler, outputs, sampler
        self.guided, self.spec, self.transfers = guided, spec, transfers

    def process(
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
            outputs += [self.sampled(r, t) for r, t in zip(to_sample, sampled, strict=True)]
        for s, verify_rows in to_verify:
            outputs.append(self._verify(s, verify_rows))
        return outputs

    def deferred(self, step: DeferredStep) -> list[RequestOutput]:
        """The outputs of a deferred step (async scheduling), waiting for its tokens."""
        return [
            self.sampled(s.request, tok)
            for s, tok in zip(step.scheduled, step.tokens.result(), strict=True)
            if not s.request.is_finished  # finished at the step before, or aborted since
        ]

    def sampled(self, request: Request, tok: SampledToken) -> RequestOutput:
        """Append one sampled token to its request and say so (text, logprob, finish)."""
        text, status = self.outputs.accept_token(request, tok.token_id)
        logprobs = [tok.logprob] if tok.logprob is not None else None
        out = self._token_output(request, [tok.token_id], text, logprobs, status)
        if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True  # with the first sampled token, once
            out.prompt_logprobs = list(request.prompt_logprobs)
        return out

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
        self.release_extras(request.request_id)
        if request.save_kv and self.transfers is not None:
            self.scheduler.finish(request, status, keep_blocks=True)
            self.transfers.start_save(request)
        else:
            self.scheduler.finish(request, status)

    def fail(self, request: Request, error: str) -> RequestOutput:
        """Finish a request the engine cannot serve; its output carries ``error``."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        out = self.ended(request)
        out.error = error
        return out

    def ended(self, request: Request) -> RequestOutput:
        """Release what a finished (failed or aborted) request holds besides its blocks;
        its last output, empty."""
        self.outputs.release(request.request_id)
        self.release_extras(request.request_id)
        return self.outputs.output(request, [], "", finished=True)

    def release_extras(self, request_id: str) -> None:
        """Drop a finished request's grammar matcher and draft-model state."""
        self.guided.release(request_id)
        if self.spec is not None:
            self.spec.release(request_id)
