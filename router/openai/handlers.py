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
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.tracing import Tracing
from router.errors import APIError, bad_request
from router.legs.orchestrator import Orchestrator, merge_streams
from router.legs.spans import RequestSpans
from router.legs.trace import Delta, Job, Trace
from router.lora import routing_root
from router.openai.admission import check_fits, check_prompt, prompts_of
from router.openai.answer import AnswerFormat, Formatter, Usage
from router.openai.client_gone import ClientGone, first_or_gone, wait_disconnect
from router.openai.coalesce import coalesced
from router.openai.deps import Deps
from router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    candidates,
    chat_params,
    completion_params,
)
from router.tools.parsers import ToolParser
from router.tools.request import request_parser

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


async def _admit(
    deps: Deps, req: CompletionRequest | ChatCompletionRequest
) -> tuple[list[Job], ToolParser | None]:
    """Validate and tokenize; the jobs to run (one per prompt) and the tool-call parser.
    Raises APIError (4xx/503)."""
    lora_name = _lora_of(deps, req.model)
    parser = request_parser(req, deps.settings) if isinstance(req, ChatCompletionRequest) else None
    params = chat_params(req) if isinstance(req, ChatCompletionRequest) else completion_params(req)
    if parser is not None and not parser.skip_special_tokens:
        params.skip_special_tokens = False  # its markers are special tokens
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
    prompts = await prompts_of(deps, req)
    limits = [check_prompt(deps, ids, params.max_tokens) for ids in prompts]
    if params.min_tokens > min(limits):
        raise bad_request(
            f"min_tokens={params.min_tokens} is more than max_tokens={min(limits)} allows",
            "min_tokens",
        )
    deps.orchestrator.check_available()
    check_fits(deps, prompts, limits)
    limit = deps.settings.max_concurrent_requests
    if limit and deps.active >= limit:
        raise APIError(
            429, f"too many concurrent requests (limit {limit}); retry later", code="rate_limited"
        )
    request_id = (
        "chatcmpl-" if isinstance(req, ChatCompletionRequest) else "cmpl-"
    ) + uuid.uuid4().hex
    deadline = time.monotonic() + deps.settings.request_timeout
    jobs = [
        Job(
            f"{request_id}-{j}" if len(prompts) > 1 else request_id,
            ids,
            deps.processor.block_hashes(ids, routing_root(lora_name)),
            params if j == 0 or req.seed is not None else params.reseeded(),
            max_tok,
            candidates(req),
            req.user,
            deadline,
            lora_name,
        )
        for j, (ids, max_tok) in enumerate(zip(prompts, limits, strict=True))
    ]
    return jobs, parser


def _lora_of(deps: Deps, model: str) -> str | None:
    """The adapter ``model`` names (None: the base model); 404 for anything else."""
    if model in deps.settings.served_model_names:
        return None
    if model in deps.adapters():
        return model
    raise APIError(
        404,
        f"the model {model!r} does not exist; this server serves {deps.model_name!r}"
        + (f" and the LoRA adapters {sorted(deps.adapters())}" if deps.adapters() else ""),
        param="model",
        code="model_not_found",
    )


def _formatter(
    deps: Deps,
    req: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    parser: ToolParser | None,
) -> Formatter:
    echo = echo_ids = None
    if isinstance(req, CompletionRequest) and req.echo:
        echo = [deps.processor.decode(job.prompt_ids) for job in jobs]
        echo_ids = [job.prompt_ids for job in jobs] if req.logprobs is not None else None
    options = req.stream_options
    return Formatter(
        chat=isinstance(req, ChatCompletionRequest),
        request_id=jobs[0].request_id.rsplit("-", 1)[0] if len(jobs) > 1 else jobs[0].request_id,
        model=req.model,
        processor=deps.processor,
        num_choices=len(jobs) * jobs[0].n,
        include_usage_field=bool(options and options.include_usage),
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        echo_text=echo,
        echo_ids=echo_ids,
        n=jobs[0].n,
        keep=req.n if jobs[0].n != req.n else None,
        client_logprobs=req.logprobs is not None and req.logprobs is not False,
        tool_parser=parser,
    )


# Builds a request's answer format from its jobs and tool-call parser (another API's shape).
AnswerShape = Callable[[list[Job], ToolParser | None], AnswerFormat]


async def handle_generation(
    request: Request,
    deps: Deps,
    req: CompletionRequest | ChatCompletionRequest,
    shape: AnswerShape | None = None,
) -> Response:
    """Run a completions or chat request end to end; ``shape``: answer in another API's
    shape (the Responses API, router/openai/responses_format.py) instead of ``req``'s own."""
    trace = Trace()
    try:
        jobs, parser = await _admit(deps, req)
    except APIError as exc:
        trace.finish(deps.metrics, outcome_of(exc))
        raise
    fmt = shape(jobs, parser) if shape is not None else _formatter(deps, req, jobs, parser)
    usage = Usage(prompt_tokens=sum(len(job.prompt_ids) for job in jobs))
    trace.prompt_tokens = usage.prompt_tokens
    deps.active += 1
    release = True
    trace.phase("router_queue", time.perf_counter() - trace.arrival)
    if deps.tracing is not None:
        _start_spans(deps.tracing, request, req, jobs, trace)
    run = _run_jobs(deps.orchestrator, jobs, trace)
    try:
        if req.stream:
            try:
                first = await first_or_gone(request, run)
            except ClientGone:  # left before its first token: its prefill is cancelled
                trace.finish(deps.metrics, "cancelled")
                return Response(status_code=499)
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


def _start_spans(
    tracing: Tracing,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    jobs: list[Job],
    trace: Trace,
) -> None:
    """The request's root span (continuing the client's ``traceparent``) and its queue span."""
    params = jobs[0].params
    attributes = {
        "gen_ai.operation.name": "chat"
        if isinstance(req, ChatCompletionRequest)
        else "text_completion",
        "gen_ai.request.model": req.model,
        "gen_ai.request.max_tokens": jobs[0].max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": jobs[0].n,
        "gen_ai.usage.input_tokens": trace.prompt_tokens,
        "pdserve.request_id": jobs[0].request_id,
        "pdserve.stream": bool(req.stream),
    }
    trace.spans = RequestSpans.begin(tracing, request.headers.items(), trace.arrival, attributes)
    trace.spans.queue(trace.arrival, trace.phases.get("router_queue", 0.0), len(jobs))


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


def _usage_now(fmt: AnswerFormat, usage: Usage, trace: Trace) -> Usage | None:
    """The usage so far for a chunk (``stream_options.continuous_usage_stats``), else None."""
    if not fmt.continuous_usage:
        return None
    usage.completion_tokens = trace.completion_tokens
    return usage


def _fill_usage(usage: Usage, trace: Trace, timings: bool) -> None:
    usage.completion_tokens = trace.completion_tokens
    usage.cached_tokens = trace.cached_tokens
    usage.timings = trace.timings() if timings else None
    usage.route = trace.route_info() if timings else None


async def _stream(
    deps: Deps,
    run: AsyncIterator[Delta],
    first: Delta,
    fmt: AnswerFormat,
    usage: Usage,
    trace: Trace,
    include_usage: bool,
    timings: bool,
) -> AsyncIterator[bytes]:
    """SSE body. Errors after the first byte travel in-band as an OpenAI error event."""
    outcome = "cancelled"  # unless we get to the end
    answered = False
    try:
        try:
            event = fmt.chunk(first, _usage_now(fmt, usage, trace))
            if event:
                yield event
            # What piled up while the last write ran goes out merged: one chunk per choice
            # for several tokens when this router falls behind (router/openai/coalesce.py).
            async with contextlib.aclosing(coalesced(run)) as batches:
                async for batch in batches:
                    events = []
                    for delta in batch:
                        trace.on_delta(delta)
                        events.append(fmt.chunk(delta, _usage_now(fmt, usage, trace)))
                    event = b"".join(events)
                    if event:  # empty while a tool-call parser holds the text back
                        yield event
            if include_usage:
                _fill_usage(usage, trace, timings)
                yield fmt.usage_chunk(usage)
            answered = True
        except APIError as exc:
            outcome = outcome_of(exc)
            logger.warning("stream %s failed: %s", fmt.request_id, exc.message)
            yield fmt.error_event(exc)
        except Exception as exc:
            outcome = "error"
            logger.exception("stream %s failed", fmt.request_id)
            yield fmt.error_event(APIError(500, f"internal error: {type(exc).__name__}"))
        if fmt.done:  # after the answer or its error event alike
            yield fmt.done
        if answered:
            outcome = "success"
    finally:
        deps.active -= 1
        trace.finish(deps.metrics, outcome)


async def _complete(
    request: Request,
    deps: Deps,
    run: AsyncIterator[Delta],
    fmt: AnswerFormat,
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
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone = watcher.done()
        watcher.cancel()
        if not work.done():
            work.cancel()  # cancels the gRPC calls inside; they send Abort
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled() and client_gone:
        trace.finish(deps.metrics, "cancelled")
        return Response(status_code=499)
    if work.cancelled():  # a cancellation from below with the client still here: never a 499
        trace.finish(deps.metrics, "error")
        raise APIError(503, "the request was cancelled inside the router; retry", code="cancelled")
    work.result()  # re-raises APIError from the run
    _fill_usage(usage, trace, timings)
    trace.finish(deps.metrics, "success")
    return JSONResponse(fmt.final(usage))
