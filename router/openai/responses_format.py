"""The answer of ``POST /v1/responses``: a ``response`` object, or its stream of typed
events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``),
in the shapes the ``openai`` client's ``responses.create`` and ``responses.stream`` read.

One output per request (the API has no ``n``). Without tools the text streams as it comes;
with tools the answer is parsed once it is whole (router/tools/parsers), so its message and
function-call items are sent at the end, each with its full text in one delta.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from router.errors import APIError
from router.legs.trace import Delta
from router.openai.answer import ChoiceState, Usage
from router.openai.responses_api import ResponsesRequest
from router.tools.parsers import ToolParser
from router.tools.parsers.stream import final_message


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


class ResponsesFormatter:
    """Builds the answer of one Responses request (the handlers' answer format)."""

    include_usage_field = True  # the closing events carry the usage
    continuous_usage = False
    done = b""  # the stream ends with response.completed, no [DONE]

    def __init__(self, req: ResponsesRequest, tool_parser: ToolParser | None) -> None:
        self.req = req
        self.request_id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.state = ChoiceState()
        self.tool_parser = tool_parser
        self._sequence = 0
        self._opened = False  # response.created sent

    def absorb(self, delta: Delta) -> tuple[ChoiceState, str]:
        self.state.text += delta.text
        self.state.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.state.finish_reason = delta.finish_reason
        return self.state, delta.text

    # -- streaming -------------------------------------------------------------------------
    def chunk(self, delta: Delta, usage: Usage | None = None) -> bytes:
        del usage  # no running usage in this API
        out: list[bytes] = []
        if not self._opened:
            self._opened = True
            shell = self._response("in_progress", [], None)
            out += [self._emit("response.created", response=shell),
                    self._emit("response.in_progress", response=shell)]  # fmt: skip
            if self.tool_parser is None:  # the text streams into one message item
                out += self._open_message(0)
        _, text = self.absorb(delta)
        if self.tool_parser is None and text:
            out.append(self._text_delta(0, text))
        return b"".join(out)

    def usage_chunk(self, usage: Usage) -> bytes:
        """The closing events: what is still open is done, then ``response.completed``."""
        out: list[bytes] = []
        items = self._items()
        if self.tool_parser is None:
            out += self._close_message(0, items[0])
        else:
            for index, item in enumerate(items):
                out += self._whole_item(index, item)
        # Always response.completed, also when cut at max_output_tokens (its status says
        # "incomplete"): the openai client's stream helper waits for that event alone.
        response = self._response(self._status(), items, usage)
        out.append(self._emit("response.completed", response=response))
        return b"".join(out)

    def error_event(self, exc: APIError) -> bytes:
        error = exc.body()["error"]
        return self._emit("error", code=error.get("code"), message=error["message"],
                          param=error.get("param"))  # fmt: skip

    # -- whole answer ----------------------------------------------------------------------
    def final(self, usage: Usage) -> dict[str, Any]:
        return self._response(self._status(), self._items(), usage)

    # -- parts -----------------------------------------------------------------------------
    def _emit(self, kind: str, **payload: Any) -> bytes:
        event = _event(kind, payload | {"sequence_number": self._sequence})
        self._sequence += 1
        return event

    def _status(self) -> str:
        return "incomplete" if self.state.finish_reason == "length" else "completed"

    def _items(self) -> list[dict[str, Any]]:
        """The output items: the message (text) and, with tools, one per function call."""
        if self.tool_parser is None:
            return [self._message_item(self.state.text, self._status())]
        message = final_message(self.tool_parser, self.state.text)
        items = []
        if message.get("content"):
            items.append(self._message_item(message["content"], self._status()))
        for call in message.get("tool_calls") or []:
            items.append(
                {
                    "type": "function_call",
                    "id": "fc_" + uuid.uuid4().hex,
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        return items or [self._message_item("", self._status())]

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [_text_part(text)] if status != "in_progress" else [],
        }

    def _open_message(self, index: int) -> list[bytes]:
        """The message item (output ``index``) and its text part begin."""
        ids = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        opened = self._message_item("", "in_progress")
        return [
            self._emit("response.output_item.added", output_index=index, item=opened),
            self._emit("response.content_part.added", **ids, part=_text_part("")),
        ]

    def _text_delta(self, index: int, text: str) -> bytes:
        return self._emit("response.output_text.delta", item_id=self.message_id,
                          output_index=index, content_index=0, delta=text, logprobs=[])  # fmt: skip

    def _close_message(self, index: int, item: dict[str, Any]) -> list[bytes]:
        part = item["content"][0]
        ids = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            self._emit("response.output_text.done", **ids, text=part["text"], logprobs=[]),
            self._emit("response.content_part.done", **ids, part=part),
            self._emit("response.output_item.done", output_index=index, item=item),
        ]

    def _whole_item(self, index: int, item: dict[str, Any]) -> list[bytes]:
        """An item sent at once (tools): opened, its one delta, done."""
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return [*self._open_message(index), self._text_delta(index, text),
                    *self._close_message(index, item)]  # fmt: skip
        ids = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        return [
            self._emit("response.output_item.added", output_index=index,
                       item=item | {"status": "in_progress", "arguments": ""}),
            self._emit("response.function_call_arguments.delta", **ids, delta=arguments),
            self._emit("response.function_call_arguments.done", **ids, arguments=arguments),
            self._emit("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def _response(
        self, status: str, items: list[dict[str, Any]], usage: Usage | None
    ) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,  # fmt: skip
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
