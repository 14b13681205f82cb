"""The router's FastAPI app: ``create_app(settings, prefill_pool, decode_pool, ...)``.

Tests build it in-process (httpx ASGI transport, or uvicorn on a free port); ``router.cli``
builds it for ``pdserve router``. Everything lives on ``app.state`` — no module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tracing import make_tracing
from common.version import installed_version
from router.errors import APIError, error_body, install_error_handlers
from router.legs.orchestrator import Orchestrator
from router.legs.rpc import LegContext
from router.legs.trace import Trace
from router.lora import adapter_cards
from router.metrics import RouterMetrics
from router.openai.body_parse import document_bodies
from router.openai.deps import Deps
from router.openai.handlers import handle_generation, outcome_of
from router.openai.lora_admin import add_lora_admin_routes
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.responses_api import ResponsesRequest
from router.openai.responses_format import ResponsesFormatter
from router.openai.tokenize_api import DetokenizeRequest, TokenizeRequest, add_tokenize_routes
from router.routing.estimator import AutoEstimator
from router.routing.pool import InstancePool
from router.settings import RouterSettings
from router.tokenizer import PromptProcessor

logger = logging.getLogger(__name__)


def key_matches(header: bytes, keys: list[bytes]) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of keys>`` (constant-time
    comparison, so the time taken says nothing about how much of a key matched)."""
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer" or not token:
        return False
    return any(hmac.compare_digest(token.strip(), key) for key in keys)


class GuardMiddleware:
    """API keys (Bearer, 401), the body-size limit (413) and the body-read deadline (408),
    before parsing.

    With keys set, every path needs one except ``/health`` (probes cannot send one; it then
    tells unauthenticated callers no more than probes need) and ``/metrics`` when
    ``public_metrics`` (for scrapers that cannot send one). That covers ``/docs`` and
    ``/openapi.json`` too, and unknown paths, so that a caller without a key learns nothing
    about the routes. Checked ahead of FastAPI so that an unauthenticated or oversized
    request never reaches JSON decoding or validation.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: list[str],
        max_body_bytes: int,
        metrics: RouterMetrics,
        public_metrics: bool = False,
        body_read_timeout: float = 30.0,
    ) -> None:
        self.app = app
        self.body_read_timeout = body_read_timeout
        self.metrics = metrics
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.open_paths = {"/health", "/metrics"} if public_metrics else {"/health"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if (
            self.api_keys
            and path not in self.open_paths
            and not key_matches(headers.get(b"authorization", b""), self.api_keys)
        ):
            body = error_body(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                None,
                "invalid_api_key",
            )
            self.metrics.requests.labels("unauthorized").inc()
            await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # Read the whole body here, bounded in size (chunked bodies have no length) and
            # in time (a client trickling it would hold a slot forever), then replay it.
            try:
                raw = await asyncio.wait_for(self._read_body(receive), self.body_read_timeout)
            except asyncio.TimeoutError:
                await self._too_slow(send)
                return
            if raw is None:
                await self._too_large(send)
                return
            receive = _replay(raw, receive)
        await self._guarded(scope, receive, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The body (what arrived before a disconnect), or None once it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _too_slow(self, send: Send) -> None:
        self.metrics.requests.labels("invalid").inc()
        body = error_body(
            f"the request body did not arrive within {self.body_read_timeout:g} s",
            "invalid_request_error",
            None,
            "request_timeout",
        )
        await _send_json(send, 408, body, {"connection": "close"})

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; a bug before the response started is answered 500 here. Left to
        the server, it would answer 500 too but then close the connection, and the
        client's next request on that keep-alive connection would fail."""
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:
                raise  # mid-response: nothing sensible can follow on this connection
            logger.exception("unhandled error in router: %s", exc)
            body = error_body(f"internal error: {type(exc).__name__}", "internal_server_error")
            await _send_json(send, 500, body, {})

    async def _too_large(self, send: Send) -> None:
        self.metrics.requests.labels("invalid").inc()
        body = error_body(
            f"request body exceeds the limit of {self.max_body_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        await _send_json(send, 413, body, {})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send: Send, status: int, body: dict[str, Any], extra: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def create_app(
    settings: RouterSettings,
    prefill_pool: InstancePool,
    decode_pool: InstancePool,
    *,
    processor: PromptProcessor,
    metrics: RouterMetrics | None = None,
    estimator: AutoEstimator | None = None,
) -> FastAPI:
    """Build the app. The pools start (discovery + health checks) with the app's lifespan
    and stop with it; pass pools built with the same ``metrics`` to get their gauges."""
    metrics = metrics or prefill_pool.metrics or RouterMetrics()
    leg = LegContext(
        prefill_pool=prefill_pool,
        decode_pool=decode_pool,
        metrics=metrics,
        prefill_timeout=settings.prefill_timeout,
        prefill_retries=settings.prefill_retries,
        decode_failovers=settings.decode_failovers,
        stream_idle_timeout=settings.stream_idle_timeout,
        processor=processor,
        block_size=processor.block_size,
        estimator=estimator or AutoEstimator(),
    )
    deps = Deps(
        settings,
        processor,
        Orchestrator(
            leg,
            settings.mode,
            decode_first=settings.decode_first,
            max_local_prefill_tokens=settings.max_local_prefill_tokens,
        ),
        metrics,
        asyncio.Semaphore(settings.preprocess_concurrency),
        tracing=make_tracing(settings.otlp_traces_endpoint, "pdserve-router"),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await prefill_pool.start()
        await decode_pool.start()
        try:
            yield
        finally:
            await prefill_pool.stop()
            await decode_pool.stop()
            for task in list(leg.background):
                task.cancel()
            if deps.tracing is not None:
                deps.tracing.shutdown()  # export the spans still buffered

    app = FastAPI(title="pdserve router", version="0.1.0", lifespan=lifespan)
    app.state.deps = deps
    install_error_handlers(app, on_invalid=metrics.requests.labels("invalid").inc)
    app.add_middleware(
        GuardMiddleware,
        api_keys=settings.api_keys,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        public_metrics=settings.public_metrics,
        body_read_timeout=settings.body_read_timeout,
    )
    _add_routes(app, deps)
    add_lora_admin_routes(app, deps)
    add_tokenize_routes(app, deps)
    document_bodies(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )
    return app


def _add_routes(app: FastAPI, deps: Deps) -> None:
    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": deps.processor.shape.max_model_len,
        }

    # The bodies are read by deps.body (router/openai/body_parse.py), not by FastAPI: element
    # limits before any model is built, large bodies decoded off the event loop.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_generation(request, deps, await deps.body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await deps.body(request, ChatCompletionRequest)
        return await handle_generation(request, deps, body)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await deps.body(request, ResponsesRequest)
        try:
            chat = body.chat_request()
        except APIError as exc:
            Trace().finish(deps.metrics, outcome_of(exc))
            raise
        return await handle_generation(
            request, deps, chat, shape=lambda _jobs, parser: ResponsesFormatter(body, parser)
        )

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [model_card(name) for name in deps.settings.served_model_names]
            + adapter_cards(deps.adapters(), deps.model_name, deps.processor.shape.max_model_len),
        }

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if model in deps.adapters():
            return adapter_cards([model], deps.model_name, deps.processor.shape.max_model_len)[0]
        if model not in deps.settings.served_model_names:
            raise APIError(
                404, f"the model {model!r} does not exist", param="model", code="model_not_found"
            )
        return model_card(model)

    keys = [k.encode() for k in deps.settings.api_keys]

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200/503 for probes; the instances' addresses and errors only without API keys or
        for a caller that sends one (they are internal addresses)."""
        orch = deps.orchestrator
        ready = orch.ready()
        pools = {"prefill": orch.prefill_pool.status(), "decode": orch.decode_pool.status()}
        header = request.headers.get("authorization", "").encode()
        if keys and not key_matches(header, keys):
            pools = {
                role: {"healthy": p["healthy"], "total": p["total"]} for role, p in pools.items()
            }
        body = {"status": "ok" if ready else "unavailable", "mode": orch.mode, **pools}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``GET /version``: the installed pdserve's version."""
        return {"version": installed_version()}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        payload, content_type = deps.metrics.exposition()
        return Response(payload, media_type=content_type)
