"""Offline generation: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Runs the engine in-process until every prompt finishes.

    ``model`` is a local Hugging Face directory or "smollm2"; other keyword arguments are
    ``EngineConfig`` fields.
    """

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        from pdserve.models import resolve_model

        self.engine = LLMEngine(EngineConfig(model=resolve_model(model), **engine_kwargs))
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self._next_request_id() for _ in prompts]
        results: dict[str, CompletionOutput] = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            token_ids = self._tokenize(prompt)  # type: ignore[arg-type]
            self.engine.add_request(rid, token_ids, p)
            results[rid] = CompletionOutput(
                token_ids, [], "", None, [] if p.logprobs is not None else None
            )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
        return [results[r] for r in ids]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token ids")
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def _next_request_id(self) -> str:
        self._next_id += 1
        return f"offline-{self._next_id}"
