"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (docs/router.md): count and inspect
tokens with the served model's tokenizer and chat template — the router answers alone,
no engine is called. Errors are the OpenAI body like everywhere else (400, 404)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.errors import APIError, bad_request
from router.openai.admission import chat_text
from router.openai.protocol import UINT32_MAX, ChatMessage, TextCheckedRequest
from router.tokenizer import LONG_TEXT, PromptProcessor

if TYPE_CHECKING:
    from router.openai.deps import Deps


class TokenizeRequest(TextCheckedRequest):
    """Either ``prompt`` (text) or ``messages`` (through the chat template), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # prompt only: the template writes its own
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]]


def add_tokenize_routes(app: FastAPI, deps: Deps) -> None:
    processor = deps.processor
    served = deps.settings.served_model_names

    def check_model(model: str | None) -> None:
        if model is not None and model not in served:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {served[0]!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await deps.body(request, TokenizeRequest)
        check_model(body.model)
        # Capped as prompts are (router/openai/admission.py): a text far over the limit is
        # refused before it is templated or tokenized, and the count after.
        limit = deps.settings.max_prompt_tokens or processor.shape.max_model_len
        param = "prompt" if body.prompt is not None else "messages"
        size = len(body.prompt or "") + sum(len(m.text()) for m in body.messages or ())
        at_least = -(-size // processor.max_token_chars)
        if at_least > limit:
            raise bad_request(
                f"the prompt has at least {at_least} tokens; the limit is {limit}", param
            )
        if size <= LONG_TEXT:
            ids = _tokenize(processor, body)
        else:
            async with deps.preprocess:
                ids = await asyncio.to_thread(_tokenize, processor, body)
        if len(ids) > limit:
            raise bad_request(f"the prompt has {len(ids)} tokens; the limit is {limit}", param)
        reply: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": processor.shape.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            reply["token_strs"] = [processor.token_text(t) for t in ids]
        return reply

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = await deps.body(request, DetokenizeRequest)
        check_model(body.model)
        vocab = processor.shape.vocab_size
        if vocab and body.tokens and max(body.tokens) >= vocab:
            raise bad_request(
                f"token id {max(body.tokens)} is outside the vocabulary (size {vocab})", "tokens"
            )
        return {"prompt": processor.decode(body.tokens, skip_special_tokens=False)}


def _tokenize(processor: PromptProcessor, body: TokenizeRequest) -> list[int]:
    """Template (messages) and tokenize: inline or on a worker thread."""
    if body.messages is not None:
        text = chat_text(
            processor,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
        )
        return processor.encode(text, add_special_tokens=False)  # the template wrote any BOS
    return processor.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
