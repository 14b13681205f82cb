"""OpenAI request bodies (pydantic, the HTTP edge) and their mapping to router parameters.

Validation is strict (no "5" for 5, no true for 1) and range-checked, so a bad request is
answered 400 before it costs a prefill. Fields the engine cannot honour are refused with a
clear message instead of being silently ignored.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.errors import bad_request
from router.legs.params import SEED_SPACE, GenParams
from router.openai.guided import NO_GUIDE, guide_of
from router.tools.request import ToolCallIn, ToolChoice, ToolList, check_tools, tool_guide
from router.tools.template import call_arguments

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 16
# The wire types of SamplingParams (proto): larger values cannot even be serialized.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def reject_surrogates(data: Any) -> None:
    """ValueError naming the first string (value or key) of a JSON body that holds a lone
    UTF-16 surrogate (JSON ``"\ud800"``): such text cannot be encoded as UTF-8, so the
    tokenizer, the gRPC messages and even an error body echoing it would fail. Walks
    iteratively, so deep nesting costs no recursion."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            items: list[tuple[str, Any]] = []
            strings = [value]
        elif isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            strings = [k for k in value if isinstance(k, str)]
        elif isinstance(value, list):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
            strings = []
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{path or 'body'}: contains a lone UTF-16 surrogate; text must be valid "
                    "Unicode"
                ) from None
        stack.extend(reversed(items))


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (with include_usage).
    continuous_usage_stats: bool = False


class TextCheckedRequest(BaseModel):
    """A request body whose every string is valid Unicode (no lone surrogate), strict types."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        reject_surrogates(data)
        # OpenAI's schemas make the optional fields nullable and some clients send every
        # field, null included (`"n": null`, `"stream": null`): null means the default.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class _CommonRequest(TextCheckedRequest):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32_MAX)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the model's context).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    pdserve_timings: bool = False
    # Guided decoding (router/openai/guided.py): vLLM's extensions or OpenAI's response_format.
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM extensions this server cannot honour: refused rather than ignored (docs/router.md
    # "Refused fields" gives the reasons).
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _check_common(self) -> _CommonRequest:
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: the context)")
        if self.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs (vLLM's separate output) is not supported; send echo with "
                "logprobs on /v1/completions for the prompt's logprobs"
            )
        if self.use_beam_search:
            raise ValueError(
                "use_beam_search is not supported: the engine samples, it has no beam search"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop accepts at most {MAX_STOP} strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        logit_bias_of(self)  # token ids as keys, biases in [-100, 100] (ValueError otherwise)
        guide_of(self)  # at most one guide, each well-shaped (ValueError otherwise)
        return self


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``."""

    prompt: (
        str
        | list[str]
        | list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best are known at the end)")
        if self.suffix:
            # No served model family has a fill-in-the-middle template here (docs/router.md).
            raise ValueError("suffix is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Without this an image or audio part fails every branch of the union and the
        # client reads "content.str: Input should be a valid string": name the part instead.
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part of type {kind!r} is not supported: the served models "
                        "are text-only, send parts of type 'text'"
                    )
        return content

    @model_validator(mode="after")
    def _tool_turn_names_its_call(self) -> ChatMessage:
        # As OpenAI: a tool result answers one earlier call, named by its id.
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (router/tools/template.py)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call_arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Extra variables for the chat template (vLLM's), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: ToolList | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        check_tools(self, guided=guide_of(self) != NO_GUIDE)
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


def gen_params(req: _CommonRequest, *, max_tokens: int | None, logprobs: int | None) -> GenParams:
    """Map the validated body to :class:`GenParams`; ranges were checked by pydantic."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    top_k = -1 if req.top_k in (None, 0) else int(req.top_k)
    seed = secrets.randbelow(SEED_SPACE) if req.seed is None else req.seed % SEED_SPACE
    guided_kind, guided_value = guide_of(req)
    return GenParams(
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        stop=stops,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        guided_kind=guided_kind,
        guided_value=guided_value,
        logit_bias=logit_bias_of(req),
    )


def logit_bias_of(req: _CommonRequest) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) as ids; ValueError when a key is
    not a token id or a bias is outside [-100, 100]. The vocabulary bound is the app's."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token <= UINT32_MAX:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        out[token] = float(bias)
    return out


def candidates(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Choices to generate per prompt: ``best_of`` when given (the ``n`` best are kept)."""
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        return req.best_of
    return req.n


def completion_params(req: CompletionRequest) -> GenParams:
    # The legacy completions API defaults to 16 tokens. best_of > n ranks the candidates by
    # their cumulative logprob, so every token's logprob is needed (router/openai/best_of.py).
    logprobs = req.logprobs
    if req.best_of is not None and req.best_of > req.n and logprobs is None:
        logprobs = 0
    params = gen_params(req, max_tokens=req.max_tokens or 16, logprobs=logprobs)
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = req.logprobs  # the echoed prompt's logprobs, from the prefill
    return params


def chat_params(req: ChatCompletionRequest) -> GenParams:
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; give one", "max_completion_tokens"
        )
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = gen_params(req, max_tokens=max_tokens, logprobs=logprobs)
    guide = tool_guide(req)
    if guide is not None:  # required / named tool_choice (router/tools/request.py)
        params.guided_kind, params.guided_value = guide
    return params
