"""``RouterArgs``: every flag of ``pdserve router``, declared once (docs/design.md §3
"Settings"; the user guide: docs/router.md).

Each field is one setting: default, unit, the argparse type that validates it, help, its
``PDSERVE_*`` twin (from the flag) and the Helm value that sets it. ``router.cli`` adds the
flags (``RouterArgs.add_arguments``) and builds the app from the parsed namespace; `pdserve
up` passes its router the few it sets itself and those declared ``forward=True``.
Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.flags import non_negative_int, positive_int
from common.settings import ArgsModel, setting
from common.tracing import ENDPOINT_HELP
from router.routing.policies import POLICY_NAMES
from router.tools.parsers import PARSERS


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def optional_positive_int(text: str) -> int | None:
    """argparse type: an integer >= 1, or empty / ``none`` / 0 for "not set"."""
    if text.strip().lower() in {"", "none", "0"}:
        return None
    return positive_int(text)


@dataclass
class RouterArgs(ArgsModel):
    """The flags of ``pdserve router`` (group "router" of its help)."""

    GROUP = "router"

    host: str = setting("127.0.0.1", help="HTTP listen address")
    port: int = setting(8000, type=non_negative_int, help="HTTP port")
    model: str = setting(
        "smollm2",
        help="model name (see `pdserve models`) or local HF directory (tokenizer + config)",
    )
    served_model_name: str = setting(
        "", help="name(s) clients use as `model`, comma-separated; default: the --model value"
    )
    mode: str = setting(
        "disaggregated",
        choices=("disaggregated", "colocated", "auto"),
        help="prefill placement",
        helm="router.mode",
    )
    prefill_urls: str = setting("", help="static prefill instances host:port,...")
    decode_urls: str = setting("", help="static decode instances host:port,...")
    discovery: str = setting(
        "static",
        choices=("static", "k8s", "dns", "file"),
        help="where instances come from",
        helm="router.discovery",
    )
    instances_file: str = setting(
        "",
        help='file: JSON {"prefill": ["host:port", ...], "decode": [...]}, re-read when it '
        "changes (pdserve up rewrites it when it moves a child to new ports)",
    )
    prefill_service: str = setting("", help="k8s/dns: the prefill (headless) Service name")
    decode_service: str = setting("", help="k8s/dns: the decode (headless) Service name")
    namespace: str = setting("default", help="k8s: namespace of the Services")
    service_port: int = setting(
        0,
        type=non_negative_int,
        help="k8s/dns: gRPC port of both pools; 0 = 50051 prefill, 50052 decode",
    )
    k8s_api_url: str = setting(
        "", help="k8s: API URL (default: in-cluster config, else kubeconfig)"
    )
    prefill_policy: str = setting(
        "least_load",
        choices=POLICY_NAMES,
        help="prefill routing policy",
        forward=True,
        helm="router.prefillPolicy",
    )
    decode_policy: str = setting(
        "least_load",
        choices=POLICY_NAMES,
        help="decode routing policy",
        forward=True,
        helm="router.decodePolicy",
    )
    # Routing on the blocks instances hold (docs/router.md "Routing on held blocks").
    prefix_index: str = setting(
        "events",
        choices=("events", "guess"),
        help="what routing knows of each instance's KV cache: events = the engines' KV "
        "events where they publish them (the guess elsewhere); guess = only what the "
        "router sent where",
        helm="router.prefixIndex",
        forward=True,
    )
    kv_index_max_entries: int = setting(
        500_000,
        type=positive_int,
        help="most (block, instance) entries of each pool's event index (~330 bytes "
        "each); beyond it the fullest instance's oldest entries are dropped",
        helm="router.kvIndexMaxEntries",
    )
    kv_pending_window: float = setting(
        10.0,
        type=non_negative_float,
        unit="s",
        help="with the event index: blocks routed to an instance this recently count as "
        "held there until its events catch up (a conversation's next turn often comes "
        "first); 0 = events only",
        helm="router.kvPendingWindow",
        forward=True,
    )
    prefix_weight_device: float = setting(
        1.0,
        type=non_negative_float,
        help="prefix_aware: worth of a held block in the engine's KV cache",
        helm="router.prefixWeights.device",
        forward=True,
    )
    prefix_weight_host: float = setting(
        0.8,
        type=non_negative_float,
        help="prefix_aware: worth of a held block in the engine's host-memory tier",
        helm="router.prefixWeights.host",
        forward=True,
    )
    prefix_weight_store: float = setting(
        0.5,
        type=non_negative_float,
        help="prefix_aware: worth of a held block in the KV store",
        helm="router.prefixWeights.store",
        forward=True,
    )
    prefix_load_weight: float = setting(
        1.0,
        type=non_negative_float,
        help="prefix_aware: held blocks one unit of load (waiting x 4 + running) outweighs",
        helm="router.prefixWeights.load",
        forward=True,
    )
    decode_first: str = setting(
        "full",
        choices=("full", "off"),
        help="full: a request whose every full prompt block a decode instance holds (by "
        "its KV events) goes there without a prefill; off: never",
        helm="router.decodeFirst",
        forward=True,
    )
    max_local_prefill_tokens: int = setting(
        256,
        type=non_negative_int,
        unit="tokens",
        help="with --decode-first full: a decode instance whose KV events show it holds a "
        "prefix of the prompt computes the rest itself, without a prefill, when at most this "
        "many tokens are missing (conditional disaggregation); 0: only whole prompts",
        helm="router.maxLocalPrefillTokens",
        forward=True,
    )
    api_key: str = setting(
        "",
        repr=False,
        help="require 'Authorization: Bearer KEY' on every path but /health "
        "(comma-separated for several keys)",
    )
    grpc_token: str = setting(
        "",
        repr=False,
        help="send 'authorization: Bearer TOKEN' on every gRPC call (the services' "
        "--grpc-token; prefer the environment twin)",
    )
    grpc_tls_cert: str = setting("", help="PEM: the router's client certificate (chain)")
    grpc_tls_key: str = setting("", help="PEM: the router's client private key")
    grpc_tls_ca: str = setting("", help="PEM: the CA that signs the services' certificates")
    grpc_tls_server_name: str = setting(
        "",
        help="name to verify in every service's certificate instead of the dialed "
        "address (for pod IPs from k8s discovery)",
    )
    public_metrics: bool = setting(
        switch=True,
        help="serve /metrics without the API key (for scrapers that cannot send one)",
        helm="router.apiKey.publicMetrics",
    )
    otlp_traces_endpoint: str = setting("", help=ENDPOINT_HELP, helm="tracing.otlpTracesEndpoint")
    max_prompt_tokens: int | None = setting(
        None,
        type=optional_positive_int,
        unit="tokens",
        help="longest prompt accepted (400 beyond); default: model context",
    )
    max_model_len: int | None = setting(
        None,
        type=optional_positive_int,
        unit="tokens",
        help="context length (prompt + output); default: from config.json",
    )
    max_body_bytes: int = setting(
        4 * 1024 * 1024,
        type=positive_int,
        unit="bytes",
        help="largest request body (413 beyond)",
    )
    max_chat_messages: int = setting(
        1024, type=positive_int, help="most messages in one chat request (400 beyond)"
    )
    max_batch_prompts: int = setting(
        64, type=positive_int, help="most prompts in one completions request (400 beyond)"
    )
    body_read_timeout: float = setting(
        30.0,
        type=positive_float,
        unit="s",
        help="seconds a client may take to send a request body (408 after)",
    )
    header_read_timeout: float = setting(
        10.0,
        type=positive_float,
        unit="s",
        help="seconds a connection may take to send a request's headers (closed after)",
    )
    max_connections: int = setting(
        4096, type=positive_int, help="open HTTP connections at most (503 beyond)"
    )
    preprocess_concurrency: int = setting(
        4,
        type=positive_int,
        help="requests parsed, templated and tokenized at once, off the event loop",
    )
    request_timeout: float = setting(
        600.0, type=positive_float, unit="s", help="seconds a request may take end to end"
    )
    prefill_timeout: float = setting(
        60.0, type=positive_float, unit="s", help="deadline of one Prefill call"
    )
    prefill_retries: int = setting(
        2, type=non_negative_int, help="extra prefill attempts on other instances"
    )
    decode_failovers: int = setting(
        3, type=non_negative_int, help="times a stream may resume on another decode instance"
    )
    stream_idle_timeout: float = setting(
        30.0,
        type=positive_float,
        unit="s",
        help="seconds a decode stream may go without a chunk before it resumes elsewhere",
    )
    health_interval: float = setting(
        2.0, type=positive_float, unit="s", help="seconds between health checks"
    )
    health_timeout: float = setting(
        1.0, type=positive_float, unit="s", help="deadline of one health check / GetLoad"
    )
    max_concurrent_requests: int = setting(
        0,
        type=non_negative_int,
        help="429 beyond this many in-flight requests; 0 = no limit",
    )
    block_size: int = setting(
        16,
        type=positive_int,
        unit="tokens",
        help="KV block size of the engines (prefix hashing)",
    )
    allow_runtime_lora_updating: bool = setting(
        switch=True,
        forward=True,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind the API "
        "key (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; docs/lora.md)",
    )
    # vLLM's tool-calling flags; `pdserve up` passes them to its router (forward=True).
    enable_auto_tool_choice: bool = setting(
        switch=True,
        forward=True,
        help='serve tool_choice "auto" (the default with tools): the --tool-call-parser '
        "reads calls out of the answer",
    )
    tool_call_parser: str = setting(
        "",
        choices=("", *sorted(PARSERS)),
        forward=True,
        help="format of the model's tool calls: " + ", ".join(sorted(PARSERS)),
    )
