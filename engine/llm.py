"""Offline generation: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.outputs import CompletionOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.llm_warmup import warm_up
from engine.lora.request import LoRARequest
from engine.lora_serving import lora_names

# What one prompt may be (vLLM's forms): text, token ids, or a TextPrompt/TokensPrompt dict.
PromptInput = str | list[int] | dict[str, Any]

# Step token budget of the offline path on CUDA when the caller sets none: the value
# benchmarks/gpu/gpu_bench.py runs with. The engine's 2048 suits a server's latency; an offline
# batch spends 4x as many steps prefilling with it, each one a mixed (eager) step next to
# the running decodes (docs/design.md §3 "Offline LLM").
CUDA_OFFLINE_MAX_BATCHED_TOKENS = 8192
OFFLINE_LORA_WAIT_S = 365 * 86400.0  # no deadline for a LoRA slot in offline generation


class LLM:
    """Runs the engine in-process until every prompt finishes.

    ``model`` is a local Hugging Face directory or "smollm2"; other keyword arguments are
    ``EngineConfig`` fields (``tensor_parallel_size=2`` shards the model over two processes,
    ``pipeline_parallel_size=2`` splits its layers into two stages).
    On CUDA, ``max_num_batched_tokens`` defaults to ``CUDA_OFFLINE_MAX_BATCHED_TOKENS``
    and ``warmup`` (None: on for CUDA) runs one throwaway batch at construction so the
    first ``generate`` does not pay for kernel compilation (engine/llm_warmup.py).
    """

    def __init__(self, model: str, *, warmup: bool | None = None, **engine_kwargs: Any) -> None:
        from common.models import resolve_model

        # Offline there is nobody to answer "retry later": a request waits for a LoRA
        # slot until running ones free one (docs/lora.md).
        engine_kwargs.setdefault("lora_wait_timeout", OFFLINE_LORA_WAIT_S)
        if str(engine_kwargs.get("device", "cpu")).startswith("cuda"):
            engine_kwargs.setdefault("max_num_batched_tokens", CUDA_OFFLINE_MAX_BATCHED_TOKENS)
        self.engine = LLMEngine(EngineConfig(model=resolve_model(model), **engine_kwargs))
        self._next_id = 0
        self.warmup_seconds = 0.0
        if warmup if warmup is not None else self.engine.config.device != "cpu":
            self.warmup_seconds = warm_up(self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size`` > 1); idempotent.
        They also stop when this object is collected or the interpreter exits."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; results in prompt order.

        ``lora_request`` (vLLM's): the LoRA adapter for every prompt, or one per prompt
        (None: the base model); the engine needs ``enable_lora=True`` and registers an
        adapter the first time its name comes (docs/lora.md).

        A prompt is text, a list of token ids, or one of vLLM's prompt dicts
        (``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``). One prompt may be passed
        alone. Anything else raises ``ValueError`` before any request starts.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        token_lists = [self._tokenize(prompt) for prompt in prompts]
        params_list = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        loras = lora_names(self.engine.lora, lora_request, len(prompts))
        ids = [self._next_request_id() for _ in prompts]
        results: dict[str, CompletionOutput] = {}
        # Text deltas per request, joined once at the end: ``res.text += delta`` on an
        # attribute copies the whole text every token (quadratic in the output length).
        texts: dict[str, list[str]] = {}
        for rid, token_ids, p, lora in zip(ids, token_lists, params_list, loras):
            self.engine.add_request(rid, token_ids, p, lora_name=lora)
            results[rid] = CompletionOutput(
                token_ids, [], "", None, [] if p.logprobs is not None else None
            )
            texts[rid] = []
        engine = self.engine
        while engine.has_unfinished():
            for out in engine.step():
                res = results[out.request_id]
                res.token_ids += out.new_token_ids
                if out.new_text:
                    texts[out.request_id].append(out.new_text)
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason = out.finish_reason
        for rid, res in results.items():
            res.text = "".join(texts[rid])
        return [results[r] for r in ids]

    def _tokenize(self, prompt: object) -> list[int]:
        """Token ids of one prompt; ``ValueError`` for a shape that is not a prompt."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError(
                    'a prompt dict holds exactly one of "prompt" or "prompt_token_ids", '
                    f"got keys {sorted(prompt)}"
                )
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token ids")
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        raise ValueError(
            "a prompt is a string, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def _next_request_id(self) -> str:
        self._next_id += 1
        return f"offline-{self._next_id}"
