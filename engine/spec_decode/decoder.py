"""The engine's speculative-decoding driver: propose before scheduling, verify after the
target step, count acceptance.

Per engine step: ``propose(running)`` sets ``Request.spec_token_ids`` on every running
request that is at a decode step (one pending token) and is not constrained by a logits
processor (a grammar mask would be needed at every drafted position); the scheduler gives
each the budget and KV slots for ``1 + drafts`` tokens (dropping the drafts rather than
preempting when short); the model runner returns logits for all those positions; then
``verify`` accepts a prefix and emits the accepted tokens plus one more. Rejected drafts'
KV slots sit past ``num_computed_tokens`` and are overwritten by later steps; the engine
advances ``num_computed_tokens`` by the accepted count only, so it stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.config.speculative import SpeculativeConfig
from engine.core.request import Request
from engine.models import ModelArgs
from engine.sampling.sampler import Sampler
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.verify import Emit, verify


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since the engine started (acceptance rate = accepted / drafted)."""

    method: str
    k: int
    num_rounds: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = (
        0  # tokens produced by those rounds (accepted + 1 each, or fewer at a stop)
    )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        return self.num_emitted_tokens / self.num_rounds if self.num_rounds else 0.0


class SpecDecoder:
    def __init__(
        self,
        config: EngineConfig,
        spec: SpeculativeConfig,
        args: ModelArgs,
        max_model_len: int,
        num_blocks: int,
        tokenizer: object,
    ) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(spec.method, spec.k)
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(spec.n, spec.min_n)
        else:
            self.draft = DraftModelProposer(
                config, spec, args, max_model_len, num_blocks, tokenizer
            )
        self._draft_probs: dict[str, torch.Tensor] = {}

    def _max_drafts(self, request: Request) -> int:
        # The last allowed token (max_tokens or max_model_len) is always the verified extra one.
        return max(0, min(self.spec.k, request.tokens_left(self.max_model_len) - 1))

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` on every running request (empty when not drafting)."""
        wanted: list[tuple[Request, int]] = []
        for request in running:
            request.spec_token_ids = []
            if request.num_tokens - request.num_computed_tokens != 1 or request.logits_processors:
                continue
            max_k = self._max_drafts(request)
            if max_k > 0:
                wanted.append((request, max_k))
        self._draft_probs.clear()
        if self.ngram is not None:
            for request, max_k in wanted:
                request.spec_token_ids = self.ngram.propose(request.all_token_ids, max_k)
        elif self.draft is not None and wanted:
            by_id = {r.request_id: r for r, _ in wanted}
            for rid, draft in self.draft.propose(wanted).items():
                request = by_id[rid]
                request.spec_token_ids = draft.tokens
                if draft.probs is not None:
                    self._draft_probs[rid] = draft.probs

    def verify(
        self, sampler: Sampler, request: Request, rows: torch.Tensor, drafts: list[int], emit: Emit
    ) -> int:
        """Emit the request's tokens for this step; returns how many were emitted."""
        probs = self._draft_probs.pop(request.request_id, None)
        if probs is not None:
            probs = probs[: len(drafts)].to(rows.device)
        before = len(request.output_token_ids)
        accepted = verify(sampler, request, rows, drafts, probs, emit)
        emitted = len(request.output_token_ids) - before
        self.stats.num_rounds += 1
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_tokens += accepted
        self.stats.num_emitted_tokens += emitted
        return emitted

    def release(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)
