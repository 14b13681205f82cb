"""Token sampling: logit bias, penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Reproducibility: the random draw for a token depends only on the request's seed and the
token's position (exponential-race sampling with a generator seeded from both), so a seed
gives the same output in any batch, and a request resumed on another instance continues
exactly where it stopped. Requests without a seed get one from the engine at arrival.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request

# A logits processor sees the tokens generated so far and the row's logits, and returns
# the logits to sample from (e.g. a grammar bitmask sets disallowed tokens to -inf).
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


def position_seed(seed: int, position: int) -> int:
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    p = request.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(request.all_token_ids)), dtype=torch.long, device=logits.device
        )
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    add = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    logits[ids] += add
    return logits


def mask_stop_tokens(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Rule out every token that would end the request (``min_tokens`` not reached yet)."""
    ends = set(request.params.stop_token_ids)
    if not request.params.ignore_eos:
        ends |= request.eos_token_ids
    ids = [t for t in ends if t < logits.shape[0]]
    if ids:
        logits[torch.tensor(ids, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min-p."""
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token if the mass strictly before it is below top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def exponential_noise(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Exponential(1) draws shaped and typed as ``like``, from ``gen``.

    On the CPU as ``-log(u)`` of float64 uniforms: with torch's CPU ``exponential_`` a step
    of 64 sampled 49,152-token rows took 50.8 ms, with this 21.9 ms (one thread;
    benchmarks/engine/sampling_noise.py), and a burst of sampled requests had spent 28 % of
    a prefill service's time in that call (docs/design.md §3 "Sampling").
    ``u`` is in [0, 1): ``u = 0`` (chance 2^-53 a token) gives infinite noise, which only
    rules that token out of the race. On a GPU ``exponential_`` is already fast and stays."""
    if like.device.type == "cpu":
        u = torch.empty(like.shape, dtype=torch.float64).uniform_(generator=gen)
        return u.log_().neg_().to(like.dtype)
    return torch.empty_like(like).exponential_(generator=gen)


def _race_noise(probs: torch.Tensor, request: Request, position: int) -> torch.Tensor:
    """Exponential noise for the race ``argmax(probs / noise)``, drawn on the device from
    a generator seeded by the request's seed and the token's position only."""
    gen = torch.Generator(device=probs.device)
    gen.manual_seed(position_seed(request.effective_seed, position))
    return exponential_noise(probs, gen)


class PendingTokens:
    """One step's sampled tokens on their way to the host.

    ``tokens`` (int64, on the logits' device) can feed the next step's inputs before the
    host has seen them (async scheduling); ``result()`` waits for the non-blocking copy
    and decodes it. The copy is the step's one device->host transfer.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        packed: torch.Tensor,
        decode: Callable[[list[float]], list[SampledToken]],
    ) -> None:
        self.tokens = tokens
        self._decode = decode
        self._copied: torch.cuda.Event | None = None
        if packed.device.type != "cuda":
            self._host = packed
            return
        # Pinned, so the copy is truly asynchronous (one into pageable memory would make the
        # host wait for the GPU right here); the event says when it has landed.
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host.copy_(packed, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> list[SampledToken]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._decode(self._host.tolist())


def _greedy_tokens(host: list[float]) -> list[SampledToken]:
    return [SampledToken(int(t), None) for t in host]


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Pick one token per row of ``logits`` ``[len(requests), vocab]`` (float32)."""
        return self.launch(logits, requests).result()

    def launch(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        positions: list[int] | None = None,
    ) -> PendingTokens:
        """Start sampling one token per row without waiting for the device.

        ``positions`` are the sampled tokens' indices in their sequences (they key the
        seeded draws); by default each request's ``num_tokens``. Under async scheduling a
        request's newest tokens may still be in flight, so the engine passes them."""
        if all(
            r.params.plain_greedy
            and r.params.logprobs is None
            and not r.logits_processors
            and not r.below_min_tokens
            for r in requests
        ):
            tokens = logits.argmax(-1)
            return PendingTokens(tokens, tokens, _greedy_tokens)
        if positions is None:
            positions = [r.num_tokens for r in requests]
        return self._sample_batch(logits, requests, positions)

    def _sample_batch(
        self, logits: torch.Tensor, requests: list[Request], positions: list[int]
    ) -> PendingTokens:
        """The general path, batched so a step costs one device->host copy (not one sync
        per request): each row's scores are built on the device (processed logits for a
        greedy row, ``probs / noise`` for a sampled one: the same exponential race as
        ``draw``), one argmax picks every token, and the tokens and any logprobs come back
        in one packed float64 tensor (token ids < 2^53 are exact in it)."""
        scores = []
        for i, request in enumerate(requests):
            processed = self.processed_logits(logits[i], request)
            if request.params.greedy:
                scores.append(processed)
            else:
                probs = processed.softmax(-1)
                scores.append(probs / _race_noise(probs, request, positions[i]))
        tokens = torch.stack(scores).argmax(-1)
        wanted = [r.params.logprobs for r in requests]
        parts = [tokens.double()]
        top_k = max((k for k in wanted if k is not None), default=None)
        if top_k is not None:
            logprobs = logits.log_softmax(-1)
            parts.append(logprobs.gather(1, tokens[:, None])[:, 0].double())
            if top_k > 0:
                vals, ids = torch.topk(logprobs, top_k, dim=-1)
                parts += [ids.double().flatten(), vals.double().flatten()]
        n = len(requests)

        def decode(host: list[float]) -> list[SampledToken]:
            out = []
            for i, k in enumerate(wanted):
                token = int(host[i])
                logprob = None
                if k is not None and top_k is not None:
                    a = 2 * n + i * top_k  # row i's top ids; its values are n * top_k further
                    row_ids = host[a : a + k]
                    row_vals = host[a + n * top_k : a + n * top_k + k]
                    top = [(int(t), v) for t, v in zip(row_ids, row_vals, strict=True)]
                    logprob = TokenLogprob(token, host[n + i], top)
                out.append(SampledToken(token, logprob))
            return out

        return PendingTokens(tokens, torch.cat(parts), decode)

    @staticmethod
    def processed_logits(raw: torch.Tensor, request: Request) -> torch.Tensor:
        """The logits the request's next token is drawn from (a new tensor): processors,
        penalties and, when sampling, temperature and top-k/top-p/min-p (dropped = -inf).
        Speculative verification uses it to get the target distribution."""
        p = request.params
        logits = raw.clone()
        for processor in request.logits_processors:
            logits = processor(request.output_token_ids, logits)
        if p.logit_bias:
            logits = apply_logit_bias(logits, p.logit_bias)
        if request.below_min_tokens:
            logits = mask_stop_tokens(logits, request)
        if p.has_penalties:
            logits = apply_penalties(logits, request)
        if not p.greedy:
            logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        return logits

    @staticmethod
    def draw(logits: torch.Tensor, request: Request, position: int) -> int:
        """Argmax (greedy) or the seeded exponential race for token index ``position``."""
        if request.params.greedy:
            return int(logits.argmax())
        probs = logits.softmax(-1)
        return int((probs / _race_noise(probs, request, position)).argmax())

    @staticmethod
    def _logprob(raw: torch.Tensor, token: int, k: int | None) -> TokenLogprob | None:
        if k is None:
            return None
        logprobs = raw.log_softmax(-1)
        top: list[tuple[int, float]] = []
        if k > 0:
            vals, ids = torch.topk(logprobs, k)
            top = list(zip(ids.tolist(), vals.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top)
