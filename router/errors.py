"""OpenAI-style errors: one exception type, the error body, and the app's handlers.

Every error the router returns has the body ``{"error": {"message", "type", "param",
"code"}}`` that the official ``openai`` client parses. FastAPI's 422 validation errors are
turned into 400s with that body, because OpenAI clients expect 400 for bad requests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# HTTP status → OpenAI error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


RETRY_AFTER_S = 1  # the Retry-After of every 503


class ErrorResponse(JSONResponse):
    """A JSON response with non-ASCII escaped: an error message may quote client text,
    and text that is not valid Unicode (a lone surrogate) would fail UTF-8 encoding."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First validation problem as ``(message, param)``; ``param`` is the dotted field path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and first.get("type") == "missing":
        return "the request has no body; send a JSON object (Content-Type: application/json)", None  # fmt: skip
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        # Also what FastAPI gives a JSON body sent without a JSON Content-Type (curl -d).
        return "the request body must be a JSON object sent with Content-Type: application/json", None  # fmt: skip
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem(s))"
    return text, param


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None] | None = None) -> None:
    """Route every error through the OpenAI body (422 → 400); ``on_invalid`` is called for
    each request body that fails validation (to count it)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        # Every 503 is "try again soon" (no instance, instances busy, a LoRA slot not free
        # in time): say when, as HTTP clients and the openai client's retries read it.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return ErrorResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        if on_invalid is not None:
            on_invalid()
        message, param = validation_message(exc)
        return ErrorResponse(
            error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _TYPES.get(exc.status_code, "invalid_request_error")
        return ErrorResponse(
            error_body(str(exc.detail), type_), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in router: %s", exc)
        return ErrorResponse(
            error_body(f"internal error: {type(exc).__name__}", "internal_server_error"),
            status_code=500,
        )
