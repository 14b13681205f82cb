"""Output processing (docs/design.md §2): sampled tokens → text deltas, stop checks and
``RequestOutput``s. Owns each running request's incremental detokenizer.

``LLMEngine`` decides *when* a request finishes and frees its blocks; this module decides
*whether* a token finishes it (EOS, stop token, stop string, grammar complete, length) and
what the caller sees.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.outputs import RequestOutput
from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.sampling.guided import GuidedDecoding


class OutputProcessor:
    def __init__(self, tokenizer: Any, guided: GuidedDecoding, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.guided = guided
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def start(self, request: Request) -> None:
        """Begin detokenizing a new request (after tokens it already carries)."""
        params = request.params
        self._detok[request.request_id] = IncrementalDetokenizer.start(
            self.tokenizer,
            params.stop,
            params.skip_special_tokens,
            request.output_token_ids,
            include_stop=params.include_stop_str_in_output,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request (no-op when unknown)."""
        self._detok.pop(request_id, None)

    def accept_token(self, request: Request, token: int) -> tuple[str, RequestStatus | None]:
        """Append one sampled token; returns its text and the finish status it causes."""
        request.append_output_token(token)
        finished_status = self.check_stop(request, token)
        if (
            request.params.guided is not None
            and self.guided.accept(request.request_id, [token])
            and finished_status is None
        ):
            finished_status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if self.tokenizer is None:
            # No tokenizer (dummy-weight benchmarks): no text, no stop strings; skip the
            # detokenizer, which would only keep a second copy of the output ids.
            return "", finished_status
        detok = self._detok[request.request_id]
        stops = len(request.output_token_ids) >= request.params.min_tokens
        text = detok.add([token], finished_status is not None, stops=stops)
        if finished_status is None and detok.stopped:
            finished_status = RequestStatus.FINISHED_STOPPED
        return text, finished_status

    def check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """The status ``token`` (just appended) finishes ``request`` with, or None."""
        p = request.params
        # Before min_tokens only the length ends a request (as in vLLM; sampling masks the
        # stop tokens meanwhile, so they show up only if a grammar forces one).
        early = len(request.output_token_ids) < p.min_tokens
        if not early and not p.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not early and token in p.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.tokens_left(self.max_model_len) <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def output(request: Request, tokens: list[int], text: str, *, finished: bool) -> RequestOutput:
        """A delta of ``request``: ``tokens`` and ``text`` since its previous output."""
        queued = (request.first_scheduled_time or time.monotonic()) - request.arrival_time
        return RequestOutput(
            request.request_id,
            tokens,
            text,
            finished,
            finish_reason=request.status.finish_reason if request.is_finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv_load_seconds=request.kv_load_seconds,
            kv_blocks_loaded=request.kv_blocks_loaded,
            kv_blocks_recomputed=request.kv_blocks_recomputed,
            kv_blocks_local=request.kv_blocks_local,
            kv_bytes_loaded=request.kv_bytes_loaded,
            queue_seconds=queued,
        )
