"""A request's sampling parameters inside the router: what the legs put into
``SamplingParams`` on the wire (the OpenAI bodies map to them in
``router/openai/protocol.py``)."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass, field

SEED_SPACE = 2**63  # the engine's seeded sampler takes seeds in [0, 2**63)


@dataclass(slots=True)
class GenParams:
    """Sampling parameters inside the router (what goes into ``SamplingParams`` on the wire).

    ``max_tokens`` None means "fill the context"; the app resolves it per prompt. ``seed`` is
    always set (the router draws one when the client did not) so that a stream resumed on
    another decode instance samples exactly what the lost one would have.
    """

    seed: int
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = off; k = chosen token + top-k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_kind: str = ""  # "" = no guide; else an engine GuidedSpec kind
    guided_value: str = ""
    logit_bias: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: int | None = None  # completions' echo + logprobs

    def reseeded(self) -> GenParams:
        """A copy with a fresh random seed: each prompt of a batch the client did not seed
        samples on its own (with a client seed every prompt uses it, as vLLM does, so a
        prompt in a batch samples what it would alone)."""
        return dataclasses.replace(self, seed=secrets.randbelow(SEED_SPACE))

    def choice_seed(self, index: int) -> int:
        """Seed of choice ``index``: choice 0 uses the request's seed (so n=1 matches the
        offline engine with the same seed); the others get distinct derived seeds."""
        if index == 0:
            return self.seed
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % SEED_SPACE
