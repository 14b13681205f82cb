"""What a request may ask of an engine: checked once at ``add_request``, so bad input is a
ValueError naming the field instead of a failure inside a step."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import RemoteKV
from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    block_size: int
    num_usable_blocks: int
    has_connector: bool

    def check(
        self,
        prompt: list[int],
        generated: list[int],
        params: SamplingParams,
        remote_kv: RemoteKV | None,
        save_kv: bool,
    ) -> None:
        """Raise ValueError for a request these limits cannot serve."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        total = len(prompt) + len(generated)
        if total >= self.max_model_len:
            raise ValueError(
                f"prompt has {total} tokens; the maximum is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len})"
            )
        bad = [t for t in prompt + generated if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:3]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:3]}")
        bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be in [0, {self.vocab_size}), got {bad[:3]}")
        if len(generated) >= params.max_tokens:
            raise ValueError(
                f"{len(generated)} tokens already generated but max_tokens is {params.max_tokens}"
            )
        if (remote_kv is not None or save_kv) and not self.has_connector:
            raise ValueError("this engine has no KV connector; remote_kv / save_kv are unavailable")
        needed = -(-min(total + params.max_tokens, self.max_model_len) // self.block_size)
        if needed > self.num_usable_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks but the pool has {self.num_usable_blocks}"
            )
