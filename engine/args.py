"""``EngineArgs``: the engine settings of a service as flags (docs/design.md §3 "Settings").

An engine setting's default, choices, unit and help are declared once, on its
``EngineConfig`` part (``engine/config/parts.py``); each field here derives them from there
(``engine_setting``) and adds only what is the command line's: the argparse type (which
validates), whether `pdserve up` forwards it to every engine (``forward=True``) and the
Helm value that sets it (``helm``); its ``PDSERVE_*`` twin is derived from the flag. The
prefill and decode services add these flags (``EngineArgs.add_arguments``), `pdserve up`
adds the forwarded ones, ``pdserve bench throughput|latency`` mirrors a few, and
``create_engine_config`` turns them into the engine's ``EngineConfig``: a field named like
an ``EngineConfig`` field is passed to it as is (None = the engine's own default). The
fields of ``SERVICE_ONLY`` are the service's own.

Torch-free: the services' command lines and `pdserve up` import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.flags import (
    byte_size,
    fraction,
    memory_size,
    non_negative_int,
    on_off,
    optional_int,
    positive_int,
)
from common.settings import ArgsModel, Setting, setting
from common.sizes import format_bytes
from engine.config.engine import EngineConfig
from engine.config.parts import knobs

ENGINE_KNOBS = knobs(EngineConfig)  # every engine setting's default, choices, unit, help
# The engine validates the value at startup (engine.config.speculative).
SPECULATIVE_HELP = ENGINE_KNOBS["speculative"].help
UNSET = None  # an engine flag's default that leaves the engine's own (not forwarded)
# Settings of the service process rather than EngineConfig fields (create_engine_config
# maps them); every other field must be named like an EngineConfig field (a test checks).
SERVICE_ONLY = (
    "model",
    "torch_threads",
    "no_prefix_caching",
    "no_pipeline_inflight_batches",
    "no_kv_events",
    "engine_process",
)


def engine_setting(name: str, default: Any = ..., **cli: Any) -> Any:
    """The setting of ``EngineConfig`` field ``name``: its default, choices, unit and help
    come from the field's knob (``engine/config/parts.py``); ``cli`` adds what is the
    command line's (``type``, ``forward``, ``helm``, ``switch``, ``many``, ``aliases``,
    ``roles``, or ``choices`` narrower than the engine's). ``default=UNSET``: the flag is
    unset unless given and the engine keeps its own default, which the help names."""
    spec = ENGINE_KNOBS[name]
    help_text = spec.help
    if default is UNSET and spec.default:
        shown = format_bytes(spec.default) if spec.unit == "bytes" else spec.default
        help_text += f" (engine default {shown})"
    if cli.get("switch"):
        return setting(help=help_text, **cli)
    cli.setdefault("choices", spec.choices)
    cli.setdefault("unit", spec.unit)
    return setting(spec.default if default is ... else default, help=help_text, **cli)


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
    # The config also takes "cuda:N"; a service picks its GPU through CUDA_VISIBLE_DEVICES.
    device: str = engine_setting("device", choices=("cpu", "cuda"), helm="engine.device")
    dtype: str = engine_setting("dtype", forward=True, helm="engine.dtype")
    kv_cache_dtype: str = engine_setting("kv_cache_dtype", forward=True)
    load_format: str = engine_setting("load_format", forward=True, helm="engine.loadFormat")
    block_size: int = engine_setting("block_size", type=positive_int)
    max_num_seqs: int = engine_setting(
        "max_num_seqs",
        type=positive_int,
        forward=True,
        helm=("engine.maxNumSeqs", "prefill.maxNumSeqs", "decode.maxNumSeqs"),
    )
    max_num_batched_tokens: int = engine_setting(
        "max_num_batched_tokens",
        type=positive_int,
        forward=True,
        helm=(
            "engine.maxNumBatchedTokens",
            "prefill.maxNumBatchedTokens",
            "decode.maxNumBatchedTokens",
        ),
    )
    scheduling_policy: str = engine_setting("scheduling_policy", forward=True)
    max_model_len: int | None = engine_setting("max_model_len", type=optional_int, forward=True)
    kv_cache_memory: int | None = engine_setting(
        "kv_cache_memory", UNSET, type=memory_size, forward=True
    )
    gpu_memory_utilization: float = engine_setting(
        "gpu_memory_utilization",
        type=fraction,
        helm=(
            "engine.gpuMemoryUtilization",
            "prefill.gpuMemoryUtilization",
            "decode.gpuMemoryUtilization",
        ),
    )
    attention_backend: str | None = engine_setting("attention_backend", UNSET, forward=True)
    quantization: str | None = engine_setting("quantization", forward=True)
    seed: int = engine_setting("seed", type=int, forward=True)
    guided_max_bytes: int = engine_setting("guided_max_bytes", type=byte_size, forward=True)
    guided_compile_timeout: float = engine_setting(
        "guided_compile_timeout", type=float, forward=True
    )
    guided_compile_memory: int = engine_setting(
        "guided_compile_memory", type=byte_size, forward=True
    )
    guided_cache_dir: str = engine_setting("guided_cache_dir", forward=True)
    deterministic: bool = engine_setting(
        "deterministic", switch=True, forward=True, helm="engine.deterministic"
    )
    speculative: str | None = engine_setting("speculative", type=optional_text)
    # Kernel paths still being measured per GPU kind (docs/gpu.md "CUDA graphs"): a value
    # flag (on|off), so a run can turn either way whatever the engine's default is.
    mixed_cuda_graphs: bool | None = engine_setting(
        "mixed_cuda_graphs", UNSET, type=on_off, forward=True
    )
    fp8_fused_quant: bool | None = engine_setting(
        "fp8_fused_quant", UNSET, type=on_off, forward=True
    )
    fp8_scales: str | None = engine_setting("fp8_scales", UNSET, type=str, forward=True)
    tensor_parallel_size: int = engine_setting(
        "tensor_parallel_size", type=positive_int, forward=True, helm="engine.tensorParallelSize"
    )
    pipeline_parallel_size: int = engine_setting(
        "pipeline_parallel_size",
        type=positive_int,
        forward=True,
        helm="engine.pipelineParallelSize",
        aliases=("-pp",),
    )
    # Set per pod by the Helm chart's pipeline groups (docs/kubernetes.md): a StatefulSet
    # pod's ordinal is its stage, and every stage dials stage 0's stable DNS name.
    pipeline_stage: int = engine_setting("pipeline_stage", type=non_negative_int)
    pipeline_leader: str = engine_setting("pipeline_leader")
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
    kv_events_max_queue: int = engine_setting("kv_events_max_queue", type=positive_int)
    # docs/design.md §3 "Engine thread or engine process"
    engine_process: bool = setting(
        True,
        type=on_off,
        forward=True,
        help="run the engine core in a process of its own, beside the gRPC server's "
        "(on|off); off: on a thread of the service process",
    )
    kv_offloading_size: int | None = engine_setting(
        "kv_offloading_size", UNSET, type=memory_size, forward=True, helm="engine.kvOffloadingSize"
    )
    # Multi-LoRA (docs/lora.md), vLLM's names; `--lora-modules` implies --enable-lora.
    # Not forwarded by `pdserve up` (a switch): there --lora-modules turns LoRA on.
    enable_lora: bool = engine_setting("enable_lora", switch=True)
    lora_modules: list[str] = engine_setting(
        "lora_modules", type=lora_module, many=True, forward=True
    )
    max_loras: int | None = engine_setting("max_loras", UNSET, type=positive_int, forward=True)
    max_lora_rank: int | None = engine_setting(
        "max_lora_rank", UNSET, type=positive_int, forward=True
    )
    max_cpu_loras: int | None = engine_setting("max_cpu_loras", type=positive_int, forward=True)
    lora_wait_timeout: float | None = engine_setting(
        "lora_wait_timeout", UNSET, type=float, forward=True
    )
    kv_load_failure: str | None = engine_setting(
        "kv_load_failure", roles=("decode",), helm="decode.kvLoadFailure"
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
