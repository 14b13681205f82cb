"""Verification: accept a prefix of the drafts so the output distribution is the target's.

Per drafted position j (token index ``pos``), with target distribution p (the sampler's
own processed logits: processors, penalties, temperature, top-k/top-p/min-p):
- point-mass drafts (n-gram, or a greedy draft model): draw x from p exactly as the
  sampler would without speculation (same seeded draw for ``pos``) and accept the draft
  iff x equals it. That is the standard rule with q = δ_d — accept with probability
  p(d) = min(1, p(d)/1), otherwise x ~ p restricted to tokens ≠ d = norm(max(0, p − δ_d)) —
  and it makes speculation change nothing at all: greedy and seeded outputs are identical
  with and without it.
- drafts sampled from a distribution q (draft model, sampled request): accept d with
  probability min(1, p(d)/q(d)) (uniform draw seeded by (seed, pos, "accept")); otherwise
  sample from norm(max(0, p − q)) (seeded by (seed, pos, "residual")).
Then, if every draft was accepted, the bonus token is drawn from the last row as usual.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request
from engine.sampling.sampler import Sampler, exponential_noise

# emit(token, logprob) appends a token to the request; True = the request stops there.
Emit = Callable[[int, TokenLogprob | None], bool]


def spec_seed(seed: int, position: int, tag: str) -> int:
    """A seed for one speculative draw, independent of the sampler's own stream."""
    digest = hashlib.sha256(f"{seed}:{position}:{tag}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def draw_from(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from (unnormalised, non-negative) ``probs`` by the exponential race."""
    noise = exponential_noise(probs, gen)
    return int((probs / noise).argmax())


def rejection_step(
    p: torch.Tensor, q: torch.Tensor, draft: int, seed: int, pos: int
) -> tuple[bool, int]:
    """The standard rule for a draft ``draft`` ~ ``q`` against target ``p`` (both
    normalised). Returns (accepted, token)."""
    u = float(
        torch.rand(
            (),
            generator=seeded_generator(p.device, spec_seed(seed, pos, "accept")),
            device=p.device,
        )
    )
    pd, qd = float(p[draft]), float(q[draft])
    if qd > 0.0 and u * qd < pd:
        return True, draft
    residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct
        residual = p
    return False, draw_from(residual, seeded_generator(p.device, spec_seed(seed, pos, "residual")))


def verify(
    sampler: Sampler,
    request: Request,
    rows: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    emit: Emit,
) -> int:
    """Decide the tokens of one request from its ``1 + len(drafts)`` logits ``rows``,
    calling ``emit`` for each (it appends the token, so later rows see it). Returns the
    number of drafts accepted; ``draft_probs`` (``[len(drafts), vocab]``) is None for
    point-mass drafts."""
    p = request.params
    k = p.logprobs
    fast = p.plain_greedy and not request.logits_processors and not request.below_min_tokens
    argmax = rows.argmax(-1).tolist() if fast else []
    accepted = 0
    for j in range(len(drafts) + 1):
        pos = request.num_tokens
        if fast:
            token, ok = argmax[j], j < len(drafts) and argmax[j] == drafts[j]
        else:
            logits = sampler.processed_logits(rows[j], request)
            if j == len(drafts) or draft_probs is None or p.greedy:
                token = sampler.draw(logits, request, pos)
                ok = j < len(drafts) and token == drafts[j]
            else:
                ok, token = rejection_step(
                    logits.softmax(-1), draft_probs[j], drafts[j], request.effective_seed, pos
                )
        accepted += ok
        stop = emit(token, sampler._logprob(rows[j], token, k))
        if stop or not ok:
            break
    return accepted
