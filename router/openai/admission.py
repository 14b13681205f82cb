"""Admission checks that need the prompt (docs/router.md "Input limits"): counts before
templating, templating and tokenizing (large requests on worker threads, bounded), prompt
length against the context, and the whole request against the largest instance's KV pool.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from router.errors import bad_request
from router.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from router.tokenizer import LONG_TEXT, ChatTemplateError, PromptProcessor
from router.tools.request import ToolDef
from router.tools.template import template_inputs

if TYPE_CHECKING:
    from router.openai.deps import Deps


def chat_text(
    processor: PromptProcessor,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[ToolDef] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation through the model's chat template; 400 when the template fails.
    Tools and tool turns go in as router/tools/template.py describes."""
    dicts, tool_dicts = template_inputs(
        [m.template_dict() for m in messages],
        [t.model_dump(exclude_none=True) for t in tools] if tools else None,
        knows_tools="tools" in processor.template_variables,
    )
    try:
        return processor.render_chat(
            dicts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tool_dicts,
            template_kwargs=template_kwargs,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc


# A request with more text than this (characters, all messages or prompts together) is
# templated and tokenized on a worker thread, at most ``preprocess_concurrency`` at once:
# a few huge chat bodies must not stall every stream on the event loop.
_INLINE_CHARS = LONG_TEXT


async def prompts_of(deps: Deps, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
    """Token ids of each prompt (chat: exactly one); the counts are checked first."""
    limits = deps.settings
    if isinstance(req, ChatCompletionRequest) and len(req.messages) > limits.max_chat_messages:
        raise bad_request(
            f"at most {limits.max_chat_messages} messages per request, got {len(req.messages)}",
            "messages",
        )
    prompt = getattr(req, "prompt", None)
    if (
        isinstance(prompt, list)
        and not all(isinstance(p, int) for p in prompt)
        and len(prompt) > limits.max_batch_prompts
    ):
        raise bad_request(
            f"at most {limits.max_batch_prompts} prompts per request, got {len(prompt)}",
            "prompt",
        )
    # Far too long to fit, whatever the tokenizer does: refused without tokenizing (a few
    # megabytes of text would hold a worker thread, and the GIL, for seconds).
    limit = limits.max_prompt_tokens or deps.processor.shape.max_model_len
    at_least = -(-_longest_text(req) // deps.processor.max_token_chars)
    if at_least > limit and req.truncate_prompt_tokens is None:
        raise bad_request(
            f"the prompt has at least {at_least} tokens; the limit is {limit}",
            "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
        )
    if _text_size(req) <= _INLINE_CHARS:
        return _prompts_sync(deps.processor, req)
    async with deps.preprocess:
        return await asyncio.to_thread(_prompts_sync, deps.processor, req)


def _longest_text(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters of the longest single prompt (chat: the whole conversation)."""
    if isinstance(req, ChatCompletionRequest):
        return _text_size(req)
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return max((len(p) for p in prompt if isinstance(p, str)), default=0)


def _text_size(req: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages)
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, str) else 0 for p in prompt)


def _prompts_sync(
    proc: PromptProcessor, req: CompletionRequest | ChatCompletionRequest
) -> list[list[int]]:
    keep = req.truncate_prompt_tokens
    if keep == -1:
        keep = proc.shape.max_model_len
    if isinstance(req, ChatCompletionRequest):
        text = chat_text(
            proc,
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.tools,
            req.chat_template_kwargs,
        )
        prompts = [proc.encode(text, add_special_tokens=False)]
    elif isinstance(req.prompt, str):
        prompts = [proc.encode(req.prompt)]
    elif all(isinstance(p, int) for p in req.prompt):
        prompts = [list(req.prompt)]  # type: ignore[arg-type]
    else:
        prompts = [proc.encode(p) if isinstance(p, str) else list(p) for p in req.prompt]  # type: ignore[arg-type]
    # vLLM's truncate_prompt_tokens: keep the last ``keep`` tokens (the end of a chat is
    # what the model answers).
    return prompts if keep is None else [ids[-keep:] for ids in prompts]


def check_prompt(deps: Deps, ids: list[int], max_tokens: int | None) -> int:
    """Validate one prompt's length; return the max_tokens it may use."""
    shape = deps.processor.shape
    limit = deps.settings.max_prompt_tokens or shape.max_model_len
    if not ids:
        raise bad_request("the prompt is empty after tokenization", "prompt")
    if shape.vocab_size and max(ids) >= shape.vocab_size:
        raise bad_request(
            f"prompt token id {max(ids)} is outside the vocabulary (size {shape.vocab_size})",
            "prompt",
        )
    if len(ids) > limit:
        raise bad_request(f"prompt has {len(ids)} tokens; the limit is {limit}", "prompt")
    room = shape.max_model_len - len(ids)
    if room < 1:
        raise bad_request(
            f"prompt has {len(ids)} tokens, leaving no room in the {shape.max_model_len}-token context",
            "prompt",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds the model's context of {shape.max_model_len}",
            "max_tokens",
        )
    return max_tokens


def check_fits(deps: Deps, prompts: list[list[int]], limits: list[int]) -> None:
    """400 for a request whose prompt and output could never fit in the KV pool of any
    instance even alone: refused here, before any byte is streamed, rather than by the
    decode instance after the prefill's first token (the engine's own rule, same count)."""
    capacity = deps.orchestrator.kv_capacity_blocks()
    if not capacity:
        return
    block = deps.processor.block_size
    context = deps.processor.shape.max_model_len
    for ids, max_tokens in zip(prompts, limits, strict=True):
        needed = -(-min(len(ids) + max_tokens, context) // block)
        if needed > capacity:
            raise bad_request(
                f"the prompt's {len(ids)} tokens plus max_tokens={max_tokens} need {needed} KV "
                f"blocks of {block} tokens; the largest instance holds {capacity}",
                "max_tokens",
            )
