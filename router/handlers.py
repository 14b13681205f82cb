"""The completion and chat pipelines: validate → tokenize → run → answer (JSON or SSE).

Ordering of checks is deliberate: unknown model (404) and bad prompts (400) are reported
even when no instance is up; only a valid request can get 503 for an empty pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.errors import APIError, bad_request
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, merge_streams
from router.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    chat_params,
    completion_params,
)
from router.responses import DONE, Formatter, Usage, sse
from router.settings import RouterSettings
from router.tokenizer import ChatTemplateError, PromptProcessor
from router.trace import Delta, Job, Trace

logger = logging.getLogger(__name__)

_OUTCOME_BY_STATUS = {
    400: "invalid",
    401: "unauthorized",
    404: "not_found",
    413: "invalid",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}


def outcome_of(exc: APIError) -> str:
    return _OUTCOME_BY_STATUS.get(exc.status, "error")


@dataclass(slots=True)
class Deps:
    """What the handlers use, kept on ``app.state.deps``."""

    settings: RouterSettings
    processor: PromptProcessor
    orchestrator: Orchestrator
    metrics: RouterMetrics
    active: int = 0

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]


def chat_text(
    processor: PromptProcessor,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """The conversation through the model's chat template; 400 when the template fails."""
    try:
        return processor.render_chat(
            [m.template_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc


async def _prompts_of(
    deps: Deps, req: CompletionRequest | ChatCompletionRequest
) -> list[list[int]]:
    """Token ids of each prompt (chat: exactly one)."""
    proc = deps.processor
    if isinstance(req, ChatCompletionRequest):
        text = chat_text(proc, req.messages, req.add_generation_prompt, req.continue_final_message)
        return [await proc.encode_async(text, add_special_tokens=False)]
    prompt = req.prompt
    if isinstance(prompt, str):
        return [await proc.encode_async(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > deps.settings.max_batch_prompts:
        raise bad_request(
            f"at most {deps.settings.max_batch_prompts} prompts per request, got {len(prompt)}",
            "prompt",
        )
    return [await proc.encode_async(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[arg-type]


def _check_prompt(deps: Deps, ids: list[int], max_tokens: int | None) -> int:
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


async def _admit(deps: Deps, req: CompletionRequest | ChatCompletionRequest) -> list[Job]:
    """Validate and tokenize; the jobs to run (one per prompt). Raises APIError (4xx/503)."""
    if req.model not in deps.settings.served_model_names:
        raise APIError(
            404,
            f"the model {req.model!r} does not exist; this server serves {deps.model_name!r}",
            param="model",
            code="model_not_found",
        )
    params = chat_params(req) if isinstance(req, ChatCompletionRequest) else completion_params(req)
    vocab = deps.processor.shape.vocab_size
    if vocab and any(t >= vocab for t in params.stop_token_ids):
        raise bad_request(
            f"stop_token_ids: {max(params.stop_token_ids)} is outside the vocabulary "
            f"(size {vocab})",
            "stop_token_ids",
        )
    if vocab and any(t >= vocab for t in params.logit_bias):
        raise bad_request(
            f"logit_bias: token {max(params.logit_bias)} is outside the vocabulary (size {vocab})",
            "logit_bias",
        )
    prompts = await _prompts_of(deps, req)
    limits = [_check_prompt(deps, ids, params.max_tokens) for ids in prompts]
    if params.min_tokens > min(limits):
        raise bad_request(
            f"min_tokens={params.min_tokens} is more than max_tokens={min(limits)} allows",
            "min_tokens",
        )
    deps.orchestrator.check_available()
    limit = deps.settings.max_concurrent_requests
    if limit and deps.active >= limit:
        raise APIError(
            429, f"too many concurrent requests (limit {limit}); retry later", code="rate_limited"
        )
    request_id = (
        "chatcmpl-" if isinstance(req, ChatCompletionRequest) else "cmpl-"
    ) + uuid.uuid4().hex
    deadline = time.monotonic() + deps.settings.request_timeout
    return [
        Job(
            f"{request_id}-{j}" if len(prompts) > 1 else request_id,
            ids,
            deps.processor.block_hashes(ids),
            params if j == 0 or req.seed is not None else params.reseeded(),
            max_tok,
            req.n,
            req.user,
            deadline,
        )
        for j, (ids, max_tok) in enumerate(zip(prompts, limits, strict=True))
    ]


def _formatter(
    deps: Deps, req: CompletionRequest | ChatCompletionRequest, jobs: list[Job]
) -> Formatter:
    echo = None
    if isinstance(req, CompletionRequest) and req.echo:
        echo = [deps.processor.decode(job.prompt_ids) for job in jobs]
    return Formatter(
        chat=isinstance(req, ChatCompletionRequest),
        request_id=jobs[0].request_id.rsplit("-", 1)[0] if len(jobs) > 1 else jobs[0].request_id,
        model=req.model,
        processor=deps.processor,
        num_choices=len(jobs) * req.n,
        include_usage_field=bool(req.stream_options and req.stream_options.include_usage),
        echo_text=echo,
        n=req.n,
    )


async def handle_generation(
    request: Request, deps: Deps, req: CompletionRequest | ChatCompletionRequest
) -> Response:
    """Run a completions or chat request end to end."""
    trace = Trace()
    try:
        jobs = await _admit(deps, req)
    except APIError as exc:
        trace.finish(deps.metrics, outcome_of(exc))
        raise
    fmt = _formatter(deps, req, jobs)
    usage = Usage(prompt_tokens=sum(len(job.prompt_ids) for job in jobs))
    deps.active += 1
    release = True
    trace.phase("router_queue", time.perf_counter() - trace.arrival)
    run = _run_jobs(deps.orchestrator, jobs, trace)
    try:
        if req.stream:
            first = await anext(run, None)
            if first is None:
                raise APIError(500, "the request produced no output", code="empty_output")
            trace.on_delta(first)
            release = False  # the stream owns the slot from here
            body = _stream(
                deps, run, first, fmt, usage, trace, fmt.include_usage_field, req.pdserve_timings
            )
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(request, deps, run, fmt, usage, trace, req.pdserve_timings)
    except APIError as exc:
        trace.finish(deps.metrics, outcome_of(exc))
        raise
    except asyncio.CancelledError:
        trace.finish(deps.metrics, "cancelled")
        raise
    except Exception:
        trace.finish(deps.metrics, "error")
        raise
    finally:
        if release:
            deps.active -= 1


def _run_jobs(orch: Orchestrator, jobs: list[Job], trace: Trace) -> AsyncIterator[Delta]:
    """All choices of all prompts; prompt ``j``'s choice ``i`` is index ``j * n + i``."""
    if len(jobs) == 1:
        return orch.generate(jobs[0], trace)
    return merge_streams(
        [_reindex(orch.generate(job, trace), j * job.n) for j, job in enumerate(jobs)]
    )


async def _reindex(stream: AsyncIterator[Delta], offset: int) -> AsyncIterator[Delta]:
    async for delta in stream:
        delta.index += offset
        yield delta


def _fill_usage(usage: Usage, trace: Trace, timings: bool) -> None:
    usage.completion_tokens = trace.completion_tokens
    usage.cached_tokens = trace.cached_tokens
    usage.timings = trace.timings() if timings else None


async def _stream(
    deps: Deps,
    run: AsyncIterator[Delta],
    first: Delta,
    fmt: Formatter,
    usage: Usage,
    trace: Trace,
    include_usage: bool,
    timings: bool,
) -> AsyncIterator[bytes]:
    """SSE body. Errors after the first byte travel in-band as an OpenAI error event."""
    outcome = "cancelled"  # unless we get to the end
    try:
        yield fmt.chunk(first)
        async for delta in run:
            trace.on_delta(delta)
            yield fmt.chunk(delta)
        if include_usage:
            _fill_usage(usage, trace, timings)
            yield fmt.usage_chunk(usage)
        yield DONE
        outcome = "success"
    except APIError as exc:
        outcome = outcome_of(exc)
        logger.warning("stream %s failed: %s", fmt.request_id, exc.message)
        yield sse(exc.body())
        yield DONE
    except Exception as exc:
        outcome = "error"
        logger.exception("stream %s failed", fmt.request_id)
        yield sse(APIError(500, f"internal error: {type(exc).__name__}").body())
        yield DONE
    finally:
        deps.active -= 1
        trace.finish(deps.metrics, outcome)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _complete(
    request: Request,
    deps: Deps,
    run: AsyncIterator[Delta],
    fmt: Formatter,
    usage: Usage,
    trace: Trace,
    timings: bool,
) -> Response:
    """Collect the whole answer; a client that leaves first gets its request aborted."""

    async def collect() -> None:
        async for delta in run:
            trace.on_delta(delta)
            fmt.absorb(delta)

    work = asyncio.create_task(collect())
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # cancels the gRPC calls inside; they send Abort
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        trace.finish(deps.metrics, "cancelled")
        return Response(status_code=499)
    work.result()  # re-raises APIError from the run
    _fill_usage(usage, trace, timings)
    trace.finish(deps.metrics, "success")
    return JSONResponse(fmt.final(usage))
