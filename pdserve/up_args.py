"""``UpArgs``: the flags of `pdserve up`, declared once (docs/design.md §3 "Settings").

`pdserve up` has settings of its own (how many services, where the router listens, how
long to wait) and passes others on: every ``EngineArgs`` setting declared with
``forward=True`` is added here unset (``EngineArgs.forwarded``) and travels to every engine
only when given, and every such ``RouterArgs`` setting to the router. The store, router and GPU flags below pass their values to the children's
flags of the same name (the store's values as typed, checked here with the store's own
parsers), and a test checks them against the children's models: the same choices or
fewer, no value a child refuses. Each flag reads its ``PDSERVE_*`` twin.
Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from common.flags import fraction, non_negative_int, positive_int
from common.settings import ArgsModel, Setting, checked_text, setting
from common.tracing import ENDPOINT_HELP
from engine.args import SPECULATIVE_HELP, EngineArgs
from kv_store.args import KVStoreSettings
from pdserve.up_store import LMCACHE_DEFAULT_CAPACITY
from router.args import RouterArgs


def _kv_text(name: str) -> Any:
    """The store flag's own check (``kv_store.args``), the text passed on as typed."""
    return checked_text(KVStoreSettings.setting(name).type)


@dataclass
class UpArgs(ArgsModel):
    """`pdserve up`'s own flags; ``add_up_arguments`` adds them and the forwarded engine
    flags."""

    model: str = setting("smollm2", help="model name or local HF directory")
    prefill: int | None = setting(
        None, type=non_negative_int, help="prefill instances (1; 0 when colocated)"
    )
    decode: int = setting(1, type=positive_int, help="decode instances")
    mode: str = setting(
        "disaggregated", choices=("disaggregated", "colocated", "auto"), help="router mode"
    )
    connector: str = setting(
        "fs", choices=("fs", "redis", "lmcache", "p2p", "nixl"), help="KV handoff"
    )
    kv_store: str = setting(
        "none",
        choices=("none", "fs", "redis", "lmcache"),
        help="with --connector p2p or nixl: a store beside it (prefix reuse, fallback)",
    )
    p2p_lease_seconds: str | None = setting(
        None,
        type=_kv_text("p2p_lease_s"),
        help="p2p, nixl: how long a prefill holds blocks for the pull",
    )
    p2p_timeout: str | None = setting(
        None, type=_kv_text("p2p_timeout_s"), help="p2p, nixl: deadline of one pull, seconds"
    )
    kv_path: str | None = setting(
        None, help="fs store directory (default: a temporary one, removed at exit)"
    )
    redis_url: str | None = setting(None, help="use this Redis instead of starting redis-server")
    lmcache_url: str | None = setting(
        None, help="use this LMCache server instead of starting lmcache_server"
    )
    kv_capacity: str | None = setting(
        None,
        type=_kv_text("kv_capacity"),
        help=f"store byte bound, e.g. 4GiB (lmcache: {LMCACHE_DEFAULT_CAPACITY})",
    )
    kv_ttl: str | None = setting(None, type=_kv_text("kv_ttl"), help="seconds a stored block lives")
    host: str = setting("127.0.0.1", help="router listen address")
    served_model_name: str = setting(
        "", help="the model name clients send (default: --model as given)"
    )
    api_key: str = setting(
        "", repr=False, help="clients must send 'Authorization: Bearer KEY' (comma: several)"
    )
    port: int = setting(8000, type=positive_int, help="router port")
    grpc_tls_cert: str = setting("", help="mTLS between router and services: certificate")
    grpc_tls_key: str = setting("", help="mTLS: the certificate's private key")
    grpc_tls_ca: str = setting("", help="mTLS: the CA that signed the certificate")
    grpc_tls_server_name: str = setting("", help="mTLS: name to check in the services' certificate")
    device: str = setting("cpu", choices=("cpu", "cuda"), help="engine device")
    gpus: int | None = setting(
        None, type=positive_int, help="spread engines round-robin over N GPUs"
    )
    gpu_ids: str | None = setting(None, help="spread engines round-robin over these GPUs, e.g. 0,1")
    gpu_memory_utilization: float | None = setting(
        None,
        type=fraction,
        help="fraction of each GPU for the engines on it together (they split it); default 0.9",
    )
    # Per pool (issue 38): unset, a pool takes --tensor-parallel-size /
    # --pipeline-parallel-size; the decode re-cuts the prefill's KV when they differ.
    prefill_tensor_parallel_size: int | None = setting(
        None, type=positive_int, help="the prefill pool's --tensor-parallel-size"
    )
    decode_tensor_parallel_size: int | None = setting(
        None, type=positive_int, help="the decode pool's --tensor-parallel-size"
    )
    prefill_pipeline_parallel_size: int | None = setting(
        None, type=positive_int, help="the prefill pool's --pipeline-parallel-size"
    )
    decode_pipeline_parallel_size: int | None = setting(
        None, type=positive_int, help="the decode pool's --pipeline-parallel-size"
    )
    speculative: str | None = setting(None, help=SPECULATIVE_HELP + " (decode instances only)")
    torch_threads: int = setting(0, type=non_negative_int, help="per engine; 0 = cores // engines")
    startup_timeout: float = setting(
        600.0, type=float, unit="s", help="seconds for every part to be healthy"
    )
    shutdown_grace: float = setting(
        20.0, type=float, unit="s", help="seconds children get before SIGKILL"
    )
    log_dir: str | None = setting(
        None, help="keep child logs here (default: in the temporary directory)"
    )
    otlp_traces_endpoint: str = setting(
        "", help=ENDPOINT_HELP + "; passed to the router and every engine service"
    )
    max_restarts: int = setting(
        5,
        type=non_negative_int,
        help="restarts of one child within 60 s before pdserve up gives up; 0 = none",
    )

    @classmethod
    def all_settings(cls) -> tuple[Setting, ...]:
        """`pdserve up`'s flags: its own, then the engine and router flags it passes on."""
        return cls.settings() + EngineArgs.forwarded() + RouterArgs.forwarded()


def add_up_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Every flag of `pdserve up`, each also read from its ``PDSERVE_*`` twin."""
    for s in UpArgs.all_settings():
        s.add_to(parser)
