"""Draft-model proposer: a small model sharing the target's tokenizer drafts k tokens.

It keeps its own paged KV cache through its own ``ModelRunner`` and ``KVCacheManager``
(prefix caching off). Per target request it holds a mirror ``Request`` whose tokens are the
target's tokens plus the last drafts, and whose ``num_computed_tokens`` says how much of
that has KV in the draft cache. Each round it first rolls the mirror back to the longest
prefix still agreeing with the target (rejected drafts' KV is simply overwritten later),
feeds the target's new tokens in one batched pass, then drafts one token per pass.

A greedy request gets the draft's argmax (a point mass); a sampled request gets a token
drawn from the draft's own distribution q (same temperature / top-k / top-p / min-p),
and q is returned for the rejection rule.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.config.speculative import SpeculativeConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.executor.model_runner import ModelRunner
from engine.models import ModelArgs
from engine.sampling.sampler import filter_logits
from engine.spec_decode.verify import draw_from, seeded_generator, spec_seed

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), vocab] when sampled from q; None = point mass


def check_compatible(
    target: EngineConfig, target_args: ModelArgs, draft_dir: str, max_model_len: int
) -> ModelArgs:
    """The draft's ModelArgs, or ValueError if it cannot draft for this target."""
    draft_args = ModelArgs.from_hf(
        dataclasses.replace(target, model=draft_dir, hf_overrides={}).hf_config()
    )
    if draft_args.vocab_size != target_args.vocab_size:
        raise ValueError(
            f"speculative: draft model vocab {draft_args.vocab_size} != target vocab "
            f"{target_args.vocab_size}; the draft must share the target's tokenizer"
        )
    if draft_args.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative: draft model supports {draft_args.max_position_embeddings} positions but "
            f"max_model_len is {max_model_len}; lower max_model_len"
        )
    return draft_args


def same_vocab(target_tokenizer: object, draft_dir: str) -> bool:
    """True when the draft directory's tokenizer maps tokens to the same ids (or has none)."""
    from engine.core.detokenizer import load_tokenizer

    draft_tok = load_tokenizer(draft_dir)
    if draft_tok is None or target_tokenizer is None:
        return True
    return bool(draft_tok.get_vocab() == target_tokenizer.get_vocab())  # type: ignore[attr-defined]


class DraftModelProposer:
    def __init__(
        self,
        target: EngineConfig,
        spec: SpeculativeConfig,
        target_args: ModelArgs,
        max_model_len: int,
        target_num_blocks: int,
        tokenizer: object,
    ) -> None:
        assert spec.model is not None
        args = check_compatible(target, target_args, spec.model, max_model_len)
        if not same_vocab(tokenizer, spec.model):
            raise ValueError(
                f"speculative: the draft model {spec.model!r} has a different tokenizer vocabulary"
            )
        config = dataclasses.replace(
            target,
            model=spec.model,
            speculative=None,
            hf_overrides={},
            enable_prefix_caching=False,
            num_kv_blocks=spec.num_blocks or target_num_blocks,
            max_model_len=max_model_len,
            tensor_parallel_size=1,  # the draft runs whole, next to rank 0's shard
        )
        self.runner = ModelRunner(config, args, max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, enable_caching=False)
        self._mirrors: dict[str, Request] = {}

    def _sync(self, request: Request, max_rollback: int) -> Request:
        """The request's mirror, rolled back to the prefix agreeing with the target."""
        target = request.all_token_ids
        mirror = self._mirrors.get(request.request_id)
        if mirror is None:
            mirror = Request(request.request_id, list(target), request.params)
            self._mirrors[request.request_id] = mirror
            return mirror
        valid = min(mirror.num_computed_tokens, len(target) - 1)
        # Only the last round's drafts can disagree with the target: check just those.
        for i in range(max(0, valid - max_rollback), valid):
            if mirror.prompt_token_ids[i] != target[i]:
                valid = i
                break
        mirror.prompt_token_ids = list(target)
        mirror.num_computed_tokens = valid
        return mirror

    def _run(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        """Feed ``n`` new tokens of each mirror (slots already allocated); last-row logits."""
        scheduled = [ScheduledRequest(m, n, self.kv.block_ids(m.request_id)) for m, n in batch]
        logits = self.runner.execute(scheduled)
        for m, n in batch:
            m.num_computed_tokens += n
        return logits

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Draft up to ``max_k`` tokens for each (request, max_k); requests whose mirror
        does not fit in the draft's KV pool get no drafts this round."""
        live: list[tuple[Request, Request, int]] = []
        for request, max_k in requests:
            mirror = self._sync(request, max_k + 2)
            if (
                self.kv.allocate_slots(
                    mirror, mirror.num_tokens - mirror.num_computed_tokens + max_k - 1
                )
                is None
            ):
                self.release(request.request_id)
                continue
            live.append((request, mirror, max_k))
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _, _ in live}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in live}
        batch = [(m, m.num_tokens - m.num_computed_tokens) for _, m, _ in live]
        step = 0
        while live:
            logits = self._run(batch)
            for (request, mirror, _), row in zip(live, logits, strict=True):
                token, q = self._draft_token(row, request, mirror.num_tokens)
                mirror.prompt_token_ids.append(token)
                tokens[request.request_id].append(token)
                if q is not None:
                    probs[request.request_id].append(q)
            step += 1
            live = [item for item in live if item[2] > step]
            batch = [(m, 1) for _, m, _ in live]
        return {
            rid: Draft(toks, torch.stack(probs[rid]) if probs[rid] else None)
            for rid, toks in tokens.items()
        }

    @staticmethod
    def _draft_token(
        logits: torch.Tensor, request: Request, pos: int
    ) -> tuple[int, torch.Tensor | None]:
        """Greedy: the argmax (no q). Sampled: a draw from q, returned with q."""
        p = request.params
        if p.greedy:
            return int(logits.argmax()), None
        q = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        return draw_from(
            q, seeded_generator(q.device, spec_seed(request.effective_seed, pos, "draft"))
        ), q

    def release(self, request_id: str) -> None:
        mirror = self._mirrors.pop(request_id, None)
        if mirror is not None:
            self.kv.free(mirror)

    def active_ids(self) -> list[str]:
        return list(self._mirrors)
