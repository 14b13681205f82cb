"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``): the
log-probability of every prompt token after the ones before it, with the top-k
alternatives, from the raw logits of the prefill's own forward passes.

A request that asks for them gets the logits of *every* position of its prompt chunks
(``engine/executor/step_inputs.py`` ``logits_rows``), not only the last; they are recorded here chunk by chunk
and handed out with the request's first sampled token. Prompt positions served by the
prefix cache or loaded from a KV store have no logits, so such a request skips the prefix
cache (``engine/core/kv_cache_manager.py``); a decode instance that loads the prompt's
KV has none to give (in P/D they come from the prefill). After a recompute preemption
positions already recorded are not recorded again.
"""

from __future__ import annotations

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request


def wants_prompt_rows(request: Request) -> bool:
    """Whether this step needs the logits of every position of the request's chunk."""
    return (
        request.params.prompt_logprobs is not None
        and len(request.prompt_logprobs) < request.num_prompt_tokens - 1
    )


def record(request: Request, first_position: int, logits: torch.Tensor) -> None:
    """Record the prompt logprobs that the chunk starting at ``first_position`` yields
    (``logits``: one row per position of the chunk)."""
    k = request.params.prompt_logprobs or 0
    targets = request.prompt_token_ids
    # Row i predicts the token at first_position + i + 1; keep the prompt's, in order.
    start = len(request.prompt_logprobs) - first_position
    stop = min(logits.shape[0], len(targets) - 1 - first_position)
    if start < 0 or stop <= start:
        return
    logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
    ids = torch.tensor(
        targets[first_position + start + 1 : first_position + stop + 1], device=logprobs.device
    )
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k:
        values, indices = torch.topk(logprobs, k, dim=-1)
        tops = [
            list(zip(row_ids, row_vals, strict=True))
            for row_ids, row_vals in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    request.prompt_logprobs.extend(
        TokenLogprob(token, value, top)
        for token, value, top in zip(ids.tolist(), chosen, tops, strict=True)
    )
