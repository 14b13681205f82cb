"""Request bodies decoded under element limits, large ones off the event loop
(docs/router.md "Input limits"; issue #36).

The byte limit is the guard middleware's (router/app.py), enforced while the body is read.
Here, before any pydantic model is built: the JSON nesting depth, the number of JSON
objects and arrays, and the number of chat messages / Responses input items / batch
prompts. A body above ``inline_bytes`` is decoded, checked and validated on a worker
thread (at most ``preprocess_concurrency`` at once), so a few multi-megabyte bodies cost
the event loop one hand-off each instead of seconds of parsing that every stream waits for.

The routes take the raw request and call ``parse_body``; ``document_bodies`` puts the
models back into the OpenAPI schema FastAPI would have written for a body parameter.
"""

from __future__ import annotations

import asyncio
import email.message
import json
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError

from router.errors import APIError

M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True, frozen=True)
class BodyLimits:
    """What one body may hold; the counts are checked before any model is built."""

    max_chat_messages: int = 1024  # ``messages`` (chat, /tokenize) and Responses ``input``
    max_batch_prompts: int = 64  # a completions ``prompt`` list of texts
    max_depth: int = 64  # nesting of JSON objects and arrays (a JSON schema: about 30 levels)
    max_containers: int = 100_000  # JSON objects and arrays in the whole body
    inline_bytes: int = 64 * 1024  # larger bodies are decoded on a worker thread


def _too_complex(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="request_too_complex")


def check_shape(data: Any, limits: BodyLimits) -> None:
    """400 when ``data`` (decoded JSON) is nested too deep, holds too many objects and
    arrays, or too many messages / prompts. Walks iteratively (no recursion)."""
    if isinstance(data, dict):
        _check_counts(data, limits)
    stack: list[tuple[Any, int]] = [(data, 1)]
    containers = 0
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        containers += 1
        if depth > limits.max_depth:
            raise _too_complex(f"the body nests deeper than {limits.max_depth} levels")
        if containers > limits.max_containers:
            raise _too_complex(
                f"the body holds more than {limits.max_containers} JSON objects and arrays"
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def _check_counts(data: dict[str, Any], limits: BodyLimits) -> None:
    for key in ("messages", "input"):
        items = data.get(key)
        if isinstance(items, list) and len(items) > limits.max_chat_messages:
            raise _too_complex(
                f"at most {limits.max_chat_messages} {key} per request, got {len(items)}", key
            )
    prompt = data.get("prompt")
    if (
        isinstance(prompt, list)
        and len(prompt) > limits.max_batch_prompts
        and not all(isinstance(p, int) for p in prompt)
    ):
        raise _too_complex(
            f"at most {limits.max_batch_prompts} prompts per request, got {len(prompt)}",
            "prompt",
        )


def _invalid(kind: str, msg: str, **ctx: Any) -> RequestValidationError:
    error: dict[str, Any] = {"type": kind, "loc": ("body",), "msg": msg, "input": None}
    if ctx:
        error["ctx"] = ctx
    return RequestValidationError([error])


def decode_and_validate(
    raw: bytes, content_type: str | None, model: type[M], limits: BodyLimits
) -> M:
    """The body as ``model``: decoded as FastAPI decodes a JSON body parameter (JSON when
    the content type is absent or JSON), its shape checked, then validated. Errors are
    FastAPI's RequestValidationError or a 400 APIError, as the routes answered before."""
    if not raw:
        raise _invalid("missing", "Field required")
    if not _is_json(content_type):
        # What FastAPI gives a JSON body sent without a JSON Content-Type (curl -d).
        raise _invalid("model_attributes_type", "Input should be a valid dictionary")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_complex(f"the body nests deeper than {limits.max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _invalid("json_invalid", "JSON decode error", error=str(exc)) from None
    check_shape(data, limits)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        raise RequestValidationError(errors) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def parse_body(
    request: Request, model: type[M], limits: BodyLimits, gate: asyncio.Semaphore
) -> M:
    """``request``'s body as ``model`` (module docstring): inline when small, else on a
    worker thread behind ``gate``."""
    raw = await request.body()
    content_type = request.headers.get("content-type")
    if len(raw) <= limits.inline_bytes:
        return decode_and_validate(raw, content_type, model, limits)
    async with gate:
        return await asyncio.to_thread(decode_and_validate, raw, content_type, model, limits)


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Describe each ``POST path``'s JSON body as ``model`` in ``/openapi.json``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            shared = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                own = model.model_json_schema(ref_template="#/components/schemas/{model}")
                shared.update(own.pop("$defs", {}))
                shared[model.__name__] = own
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
