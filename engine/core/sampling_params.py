"""Per-request sampling parameters, validated at construction with actionable messages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.core.guided_spec import GuidedSpec


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match the OpenAI API's."""

    max_tokens: int = 16
    # EOS / stop_token_ids are masked and stop strings ignored until this many tokens
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = off; k >= 0 = chosen token + top-k alternatives
    # None = off; k >= 0: every prompt token's logprob + top-k (engine/sampling/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # A stop string that ends the request stays at the end of the text (vLLM's).
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # grammar constraint (JSON schema, regex, choice, EBNF)
    # token id -> added to its logit before penalties and temperature (OpenAI's logit_bias)
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        # NaN passes every "< bound" test, and NaN or inf would poison the logits.
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ValueError(f"guided must be a GuidedSpec, got {type(self.guided).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the argmax of the model's row is the token."""
        return self.greedy and not self.has_penalties and not self.logit_bias

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
