"""``EngineArgs``: the engine settings of a service, declared once (docs/design.md §3 "Settings").

Each field is one setting: its default, unit, argparse type (which validates), help, the
``PDSERVE_*`` twin (derived from the flag), whether `pdserve up` forwards it to every
engine (``forward=True``) and the Helm value that sets it (``helm``). The prefill and decode
services add these flags (``EngineArgs.add_arguments``), `pdserve up` adds the forwarded
ones, ``pdserve bench throughput|latency`` mirrors a few, and ``create_engine_config``
turns them into the engine's ``EngineConfig``: a field named like an ``EngineConfig`` field
is passed to it as is (None = the engine's own default), so a new engine knob needs one
field here and none of the callers change.

Torch-free: the services' command lines and `pdserve up` import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.flags import (
    byte_size,
    fraction,
    memory_size,
    non_negative_int,
    optional_int,
    positive_int,
)
from common.settings import ArgsModel, Setting, setting

if TYPE_CHECKING:
    from engine.config import EngineConfig

# The engine validates the value at startup (engine.config.speculative).
SPECULATIVE_HELP = (
    'speculative decoding: "ngram:k=4[,n=4,min_n=1]" or "draft:model=PATH,k=4"; unset = off'
)
# Settings of the service process rather than EngineConfig fields (create_engine_config
# maps them); every other field must be named like an EngineConfig field (a test checks).
SERVICE_ONLY = (
    "model",
    "torch_threads",
    "no_prefix_caching",
    "no_pipeline_inflight_batches",
    "no_kv_events",
)


def parse_lora_modules(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``["a=/p", "b=/q,c=/r"]`` (vLLM's ``--lora-modules`` form; one entry may hold several
    separated by spaces or commas, as the env twin does) -> ((name, path), ...);
    ``ValueError`` for an entry that is not NAME=PATH or a repeated name."""
    out = []
    for spec in specs:
        for item in spec.replace(",", " ").split():
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"a LoRA module is NAME=PATH, got {item!r}")
            out.append((name, path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA module names must be unique, got {names}")
    return tuple(out)


def lora_module(text: str) -> str:
    """argparse type of ``--lora-modules`` entries: checked, kept as given (`pdserve up`'s
    children share its working directory, so relative paths mean the same there)."""
    try:
        parse_lora_modules([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def optional_text(text: str) -> str | None:
    """argparse type: a string, empty = unset (None)."""
    return text or None


@dataclass
class EngineArgs(ArgsModel):
    """The engine flags of ``pdserve prefill|decode`` (group "engine" of their help)."""

    GROUP = "engine"

    model: str = setting("smollm2", help="model name (see `pdserve models`) or local HF directory")
    device: str = setting("cpu", choices=("cpu", "cuda"), help="device", helm="engine.device")
    dtype: str = setting(
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights/KV dtype",
        forward=True,
        helm="engine.dtype",
    )
    kv_cache_dtype: str = setting(
        "auto",
        choices=("auto", "fp8"),
        help="KV cache storage: auto = the model dtype, fp8 = float8 e4m3 (half the bytes)",
        forward=True,
    )
    load_format: str = setting(
        "auto",
        choices=("auto", "dummy"),
        help="dummy = random weights, no files",
        forward=True,
        helm="engine.loadFormat",
    )
    block_size: int = setting(16, type=positive_int, unit="tokens", help="tokens per KV block")
    max_num_seqs: int = setting(
        256,
        type=positive_int,
        help="max running requests",
        forward=True,
        helm=("engine.maxNumSeqs", "prefill.maxNumSeqs", "decode.maxNumSeqs"),
    )
    max_num_batched_tokens: int = setting(
        2048,
        type=positive_int,
        unit="tokens",
        help="token budget per step",
        forward=True,
        helm=(
            "engine.maxNumBatchedTokens",
            "prefill.maxNumBatchedTokens",
            "decode.maxNumBatchedTokens",
        ),
    )
    scheduling_policy: str = setting(
        "fcfs",
        choices=("fcfs", "priority"),
        help="order of waiting requests: fcfs, or priority (the gRPC request's priority, "
        "lower first; ties by arrival)",
        forward=True,
    )
    max_model_len: int | None = setting(
        None, type=optional_int, unit="tokens", help="max prompt+output tokens", forward=True
    )
    kv_cache_memory: int | None = setting(
        None,
        type=memory_size,
        unit="bytes",
        help="KV cache size, e.g. 512Mi or 2GiB",
        forward=True,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        type=fraction,
        help="GPU memory fraction",
        helm=(
            "engine.gpuMemoryUtilization",
            "prefill.gpuMemoryUtilization",
            "decode.gpuMemoryUtilization",
        ),
    )
    attention_backend: str | None = setting(
        None,
        choices=("auto", "torch_ref", "triton", "flash_attn"),
        help="attention kernels (engine default auto: Triton on CUDA, plus FA4 per "
        "step shape when flash-attn-4 is installed; docs/gpu.md)",
        forward=True,
    )
    quantization: str | None = setting(
        None,
        choices=("fp8",),
        help="fp8 = e4m3 weights quantized at load (docs/quantization.md); unset = "
        "the checkpoint's own (an FP8 checkpoint loads as FP8 either way)",
        forward=True,
    )
    seed: int = setting(0, type=int, help="engine seed", forward=True)
    guided_max_bytes: int = setting(
        256 * 1024,
        type=byte_size,
        unit="bytes",
        help="largest guided-decoding guide (schema, regex, grammar, choices) accepted",
        forward=True,
    )
    guided_compile_timeout: float = setting(
        20.0,
        type=float,
        unit="s",
        help="seconds a guide's grammar may take to compile before its request is refused "
        "(and the guide refused at once after that)",
        forward=True,
    )
    guided_compile_memory: int = setting(
        1 << 30,
        type=byte_size,
        unit="bytes",
        help="memory a guide's grammar compile may use (in a process of its own; over it the "
        "request is refused and the guide refused at once after that), e.g. 512Mi",
        forward=True,
    )
    guided_cache_dir: str = setting(
        "",
        help="a directory every instance can read and write (a shared volume): each "
        "compiled grammar is left there and loaded by the other instances instead of "
        "compiled again; `pdserve up` uses its run directory; empty = off",
        forward=True,
    )
    deterministic: bool = setting(
        switch=True,
        forward=True,
        help="batch-invariant kernels: a request's tokens and logits do not depend on the "
        'requests batched with it (slower; docs/running.md "Deterministic mode")',
        helm="engine.deterministic",
    )
    speculative: str | None = setting(None, type=optional_text, help=SPECULATIVE_HELP)
    tensor_parallel_size: int = setting(
        1,
        type=positive_int,
        help="shard the model over this many processes (GPUs on CUDA)",
        forward=True,
        helm="engine.tensorParallelSize",
    )
    pipeline_parallel_size: int = setting(
        1,
        type=positive_int,
        help="split the model's layers into this many pipeline stages, each of "
        "--tensor-parallel-size processes (P x N processes; GPUs on CUDA)",
        forward=True,
        helm="engine.pipelineParallelSize",
        aliases=("-pp",),
    )
    # Set per pod by the Helm chart's pipeline groups (docs/kubernetes.md): a StatefulSet
    # pod's ordinal is its stage, and every stage dials stage 0's stable DNS name.
    pipeline_stage: int = setting(
        0,
        type=non_negative_int,
        help="the pipeline stage this process runs when the stages span hosts (with "
        "--pipeline-leader)",
    )
    pipeline_leader: str = setting(
        "",
        help="HOST:PORT of stage 0's rendezvous when the stages span hosts (stage 0 listens "
        "on PORT); empty = every stage runs on this host",
    )
    no_pipeline_inflight_batches: bool = setting(
        switch=True,
        help="run one batch at a time through the pipeline stages (default: up to "
        "--pipeline-parallel-size batches in flight, so every stage works at once)",
    )
    torch_threads: int = setting(
        0, type=non_negative_int, help="torch intra-op threads; 0 = torch's default"
    )
    no_prefix_caching: bool = setting(switch=True, help="disable the local prefix cache")
    # KV events are on in the services: the router's block index is built from them, and
    # with no subscriber they cost a list append per block registered or evicted.
    no_kv_events: bool = setting(
        switch=True,
        help="do not publish KV cache events (SubscribeKvEvents answers UNIMPLEMENTED; "
        "routers fall back to guessing what this instance holds)",
    )
    kv_events_max_queue: int = setting(
        1024,
        type=positive_int,
        unit="batches",
        help="KV event batches a subscriber may fall behind before its stream is cut off "
        "(RESOURCE_EXHAUSTED; it resubscribes from a snapshot)",
    )
    kv_offloading_size: int | None = setting(
        None,
        type=memory_size,
        unit="bytes",
        forward=True,
        help="host memory (pinned on CUDA) that keeps KV blocks the device cache evicts, "
        "reloaded on a prefix hit, e.g. 4Gi; unset = no host tier",
        helm="engine.kvOffloadingSize",
    )
    # Multi-LoRA (docs/lora.md), vLLM's names; `--lora-modules` implies --enable-lora.
    # Not forwarded by `pdserve up` (a switch): there --lora-modules turns LoRA on.
    enable_lora: bool = setting(
        switch=True, help="serve LoRA adapters (also set by --lora-modules)"
    )
    lora_modules: list[str] = setting(
        (),
        type=lora_module,
        many=True,
        forward=True,
        help="LoRA adapters (HF PEFT directories) served under these model names, as "
        "NAME=PATH; the env twin holds them separated by spaces or commas",
    )
    max_loras: int | None = setting(
        None,
        type=positive_int,
        forward=True,
        help="LoRA adapters in device slots at once (engine default 1)",
    )
    max_lora_rank: int | None = setting(
        None, type=positive_int, forward=True, help="largest LoRA rank served (engine default 16)"
    )
    max_cpu_loras: int | None = setting(
        None,
        type=positive_int,
        forward=True,
        help="LoRA adapters kept checked in host memory (default max-loras)",
    )
    lora_wait_timeout: float | None = setting(
        None,
        type=float,
        unit="s",
        forward=True,
        help="seconds a request waits for a LoRA slot before it is refused (engine default 30)",
    )
    kv_load_failure: str | None = setting(
        "recompute",
        choices=("recompute", "fail"),
        roles=("decode",),
        help="a KV block missing or corrupt in the store: recompute it locally or fail the request",
        helm="decode.kvLoadFailure",
    )

    @classmethod
    def forwarded(cls, prefix: str = "per engine: ") -> tuple[Setting, ...]:
        """The settings `pdserve up` takes and passes to every engine, unset by default
        (None = the engine's default)."""
        return super().forwarded(prefix)

    def create_engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` these settings describe (imports the engine lazily).

        ``model`` is resolved with :func:`common.models.resolve_model` (a known name is
        pulled into the cache on first use); a setting left None or empty keeps the
        engine's default.
        """
        from common.models import resolve_model
        from engine.config import EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        kwargs: dict[str, Any] = {
            s.name: getattr(self, s.name)
            for s in self.settings()
            if s.name in known and getattr(self, s.name) not in (None, "")
        }
        kwargs["model"] = resolve_model(self.model)
        kwargs["enable_prefix_caching"] = not self.no_prefix_caching
        kwargs["pipeline_inflight_batches"] = not self.no_pipeline_inflight_batches
        kwargs["kv_events"] = not self.no_kv_events
        kwargs["lora_modules"] = parse_lora_modules(self.lora_modules or ())
        kwargs["enable_lora"] = self.enable_lora or bool(kwargs["lora_modules"])
        return EngineConfig(**kwargs)
