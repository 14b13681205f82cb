"""The router's settings (built from flags / ``PDSERVE_*`` env by ``router.cli``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.tools.parsers import parser_class


@dataclass(slots=True)
class RouterSettings:
    """Everything the app needs besides its pools and tokenizer.

    ``served_model_names``: names clients may pass as ``model`` (the first is reported).
    ``api_keys``: empty = no authentication; else every path but ``/health`` needs one
    (and ``/metrics`` unless ``public_metrics``). ``max_prompt_tokens`` None = the model's
    context length. ``max_concurrent_requests`` 0 = unlimited (else 429 beyond it).
    ``stream_idle_timeout``: a decode stream with no chunk for this long resumes elsewhere.
    """

    served_model_names: list[str]
    mode: str = "disaggregated"
    api_keys: list[str] = field(default_factory=list)
    public_metrics: bool = False
    max_prompt_tokens: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 600.0
    prefill_timeout: float = 60.0
    prefill_retries: int = 2
    decode_failovers: int = 3
    stream_idle_timeout: float = 30.0
    max_concurrent_requests: int = 0
    max_batch_prompts: int = 64
    # Tool calling (router/tools/request.py): "auto" needs both, as in vLLM.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_chat_messages: int = 1024
    body_read_timeout: float = 30.0
    header_read_timeout: float = 10.0
    max_connections: int = 4096
    preprocess_concurrency: int = 4
    otlp_traces_endpoint: str = ""  # "" = OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing
    allow_runtime_lora_updating: bool = False  # router/openai/lora_admin.py
    decode_first: bool = True  # router/legs/placement.py
    max_local_prefill_tokens: int = 256  # router/legs/placement.py (0: no local suffix)

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("at least one non-empty served model name is required")
        if self.mode not in ("disaggregated", "colocated", "auto"):
            raise ValueError(f"mode must be disaggregated, colocated or auto, got {self.mode!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None:
            parser_class(self.tool_call_parser)  # ValueError naming the parsers
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_local_prefill_tokens < 0:
            raise ValueError("max_local_prefill_tokens must be >= 0")
        if min(self.max_chat_messages, self.max_connections, self.preprocess_concurrency) < 1:
            raise ValueError(
                "max_chat_messages, max_connections and preprocess_concurrency must be >= 1"
            )
        if min(self.body_read_timeout, self.header_read_timeout) <= 0:
            raise ValueError("body_read_timeout and header_read_timeout must be > 0")
        if min(self.request_timeout, self.prefill_timeout, self.stream_idle_timeout) <= 0:
            raise ValueError("request_timeout, prefill_timeout and stream_idle_timeout must be > 0")
        if (
            self.prefill_retries < 0
            or self.decode_failovers < 0
            or self.max_concurrent_requests < 0
        ):
            raise ValueError(
                "prefill_retries, decode_failovers and max_concurrent_requests must be >= 0"
            )
