"""The typed parts ``EngineConfig`` is composed of (docs/design.md §3 "Settings"), each
setting declared once here with ``knob``: its default, its choices, its unit and its help.

``EngineConfig`` (``engine/config/engine.py``) inherits every part, so the engine reads
``config.max_num_seqs`` as before, and a component may be typed with the one part it reads
(``SchedulerSettings``, ``CacheSettings``, ...). ``EngineConfig.validate`` checks every
knob's choices; ``EngineArgs`` (``engine/args.py``) derives each engine flag's default,
choices, unit and help from the knob of the same name, adding only what is the command
line's (the argparse type, forwarding by `pdserve up`, the Helm value).

Torch-free: the services' command lines import it through ``engine/args.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_KEY = "pdserve.knob"


@dataclass(frozen=True, slots=True)
class Knob:
    """What one engine setting is: its default, choices (None: any value its checks
    accept), unit (for the help) and help text (the flag's)."""

    default: Any
    choices: tuple[Any, ...] | None = None
    unit: str = ""
    help: str = ""


def knob(
    default: Any = None,
    *,
    choices: tuple[Any, ...] | None = None,
    unit: str = "",
    help: str = "",  # noqa: A002 - the flag's help
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A part's field that is an engine setting; ``factory`` for a mutable default."""
    spec = Knob(default if factory is None else factory(), choices, unit, help)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def knobs(cls: type) -> dict[str, Knob]:
    """Every knob of a part (or of ``EngineConfig``), by field name."""
    return {
        f.name: f.metadata[_KEY]
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if _KEY in f.metadata
    }


def check_choices(config: Any) -> None:
    """``ValueError`` for a knob set outside its choices (None passes where it is the
    default: unset)."""
    for name, spec in knobs(type(config)).items():
        value = getattr(config, name)
        if spec.choices is None or value in spec.choices:
            continue
        if value is None and spec.default is None:
            continue
        raise ValueError(f"{name} must be one of {spec.choices}, got {value!r}")


@dataclass(frozen=True)
class ModelSettings:
    """The model and how its weights load. ``model`` is a local Hugging Face directory
    (or "smollm2", resolved by the caller)."""

    model: str
    dtype: str = knob(
        "auto", choices=("auto", "float32", "bfloat16", "float16"), help="weights/KV dtype"
    )
    load_format: str = knob(
        "auto", choices=("auto", "dummy"), help="dummy = random weights, no files"
    )
    # "fp8": e4m3 decoder projections quantized at load (engine/models/fp8.py). An FP8
    # (compressed-tensors) checkpoint is FP8 with or without it.
    quantization: str | None = knob(
        None,
        choices=("fp8",),
        help="fp8 = e4m3 weights quantized at load (docs/quantization.md); unset = "
        "the checkpoint's own (an FP8 checkpoint loads as FP8 either way)",
    )
    # FP8 scale granularity (engine/models/fp8.py, docs/quantization.md "Scales"):
    # "channel" = one weight scale per output channel, activations per token (cuBLASLt's
    # row-wise FP8 GEMM); "tensor" = one weight scale per (fused) tensor and ONE dynamic
    # activation scale per step (tensor-wise GEMM), what vLLM runs for --quantization fp8.
    # "channel" until the tensor form is measured on the GPU (issue 35).
    fp8_scales: str = knob(
        "channel",
        choices=("channel", "tensor"),
        help="FP8 scales: channel = per output channel, activations per token; tensor = "
        "one per weight tensor, one dynamic per step for activations (vLLM's fp8 default)",
    )
    hf_overrides: dict[str, Any] = knob(factory=dict, help="config.json fields to override")
    seed: int = knob(0, help="engine seed")


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache, its prefix cache, host tier, events and KV loads. The pool is
    sized by ``kv_cache_memory`` on the CPU, ``gpu_memory_utilization`` on CUDA;
    ``num_kv_blocks`` overrides both (tests use it to force preemption)."""

    block_size: int = knob(16, unit="tokens", help="tokens per KV block")
    # "fp8" = float8_e4m3fn with per-tensor scales (engine/attention/kv_quant.py;
    # docs/design.md §3 "KV cache dtype").
    kv_cache_dtype: str = knob(
        "auto",
        choices=("auto", "fp8"),
        help="KV cache storage: auto = the model dtype, fp8 = float8 e4m3 (half the bytes)",
    )
    kv_cache_memory: int = knob(1 << 30, unit="bytes", help="KV cache size, e.g. 512Mi or 2GiB")
    gpu_memory_utilization: float = knob(0.9, help="GPU memory fraction")
    num_kv_blocks: int | None = knob(None, help="KV blocks (overrides the sizes above)")
    enable_prefix_caching: bool = knob(True, help="the local prefix cache")
    # 0 = no host tier (engine/kv/host_tier.py).
    kv_offloading_size: int = knob(
        0,
        unit="bytes",
        help="host memory (pinned on CUDA) that keeps KV blocks the device cache evicts, "
        "reloaded on a prefix hit, e.g. 4Gi; unset = no host tier",
    )
    # Record prefix-cache events for subscribers (docs/design.md §3 "KV events"); the
    # services turn it on, offline use has no one to read them.
    kv_events: bool = knob(False, help="publish KV cache events")
    kv_events_max_queue: int = knob(
        1024,
        unit="batches",
        help="KV event batches a subscriber may fall behind before its stream is cut off "
        "(RESOURCE_EXHAUSTED; it resubscribes from a snapshot)",
    )
    kv_load_failure: str = knob(
        "recompute",
        choices=("recompute", "fail"),
        help="a KV block missing or corrupt in the store: recompute it locally or fail the request",
    )


@dataclass(frozen=True)
class SchedulerSettings:
    """What runs each step, and in which order."""

    max_num_seqs: int = knob(256, help="max running requests")
    max_num_batched_tokens: int = knob(2048, unit="tokens", help="token budget per step")
    max_model_len: int | None = knob(None, unit="tokens", help="max prompt+output tokens")
    enable_chunked_prefill: bool = knob(True, help="split long prompts over steps")
    scheduling_policy: str = knob(
        "fcfs",
        choices=("fcfs", "priority"),
        help="order of waiting requests: fcfs, or priority (the gRPC request's priority, "
        "lower first; ties by arrival)",
    )
    # Launch decode step n+1 before step n's tokens reach the host
    # (engine/step/async_scheduling.py). None: on for CUDA, where the host time it hides
    # is a tenth of a small model's step.
    async_scheduling: bool | None = knob(None, help="async scheduling (None: on for CUDA)")


@dataclass(frozen=True)
class KernelSettings:
    """Where and how the model runs."""

    device: str = knob("cpu", help="device")  # "cpu" | "cuda[:N]"
    attention_backend: str = knob(
        "auto",
        choices=("auto", "torch_ref", "triton", "flash_attn"),
        help="attention kernels: auto = Triton on CUDA, plus FA4 per step shape when "
        "flash-attn-4 is installed (docs/gpu.md)",
    )
    cuda_graphs: bool = knob(True, help="capture decode steps on CUDA (triton, flash_attn)")
    # Steps that carry prefill chunks replay full graphs over padded token counts up to
    # ``mixed_graph_max_tokens`` (0 = eager) when ``cuda_graphs`` is on and the attention
    # backend is Triton (engine/executor/mixed_graphs.py; docs/design.md §3 "CUDA graphs").
    # On since tests/gpu/test_mixed_graphs_gpu.py passed on an H100 80GB (2026-12-06) and
    # the online rows improved (benchmarks/peers/README.md "Online").
    mixed_cuda_graphs: bool = knob(True, help="CUDA graphs for steps with prefill chunks")
    mixed_graph_max_tokens: int = knob(2048, unit="tokens", help="largest mixed-step graph")
    # FP8 models on CUDA with the Triton layer ops: quantize each projection's input inside
    # the RMSNorm / SiLU·mul kernel that makes it (engine/models/triton_fp8_fused.py; the
    # same bytes, a launch fewer per projection). Off until measured on the GPU kinds.
    fp8_fused_quant: bool = knob(False, help="FP8 input quantization fused into its kernel")
    fused_ops: bool = knob(True, help="Triton RMSNorm/rope/SiLU kernels on CUDA")
    # Batch-invariant kernels (engine/config/deterministic.py; docs/design.md §3
    # "Deterministic mode").
    deterministic: bool = knob(
        False,
        help="batch-invariant kernels: a request's tokens and logits do not depend on the "
        'requests batched with it (slower; docs/running.md "Deterministic mode")',
    )


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor and pipeline parallelism (engine/executor/tp/, engine/executor/pp/;
    docs/design.md §3): N processes per stage, P stages, a P x N grid."""

    tensor_parallel_size: int = knob(
        1, help="shard the model over this many processes (GPUs on CUDA)"
    )
    pipeline_parallel_size: int = knob(
        1,
        help="split the model's layers into this many pipeline stages, each of "
        "--tensor-parallel-size processes (P x N processes; GPUs on CUDA)",
    )
    # Off: one batch at a time, the bubble (engine/step/pp_batches.py).
    pipeline_inflight_batches: bool = knob(True, help="up to P batches in the stages")
    # The stages spread over hosts (one pod per stage on Kubernetes, docs/kubernetes.md):
    # stage 0 hosts the rendezvous on PORT and the others dial it.
    pipeline_stage: int = knob(
        0,
        help="the pipeline stage this process runs when the stages span hosts (with "
        "--pipeline-leader)",
    )
    pipeline_leader: str = knob(
        "",
        help="HOST:PORT of stage 0's rendezvous when the stages span hosts (stage 0 listens "
        "on PORT); empty = every stage runs on this host",
    )
    # A rank that died or hangs fails the engine instead of hanging it.
    distributed_timeout: float = knob(
        300.0, unit="s", help="seconds a collective between ranks (or a rank's start) may take"
    )


@dataclass(frozen=True)
class GuidedSettings:
    """The guided-decoding budget (engine/sampling/guided.py)."""

    guided_max_bytes: int = knob(
        256 * 1024,
        unit="bytes",
        help="largest guided-decoding guide (schema, regex, grammar, choices) accepted",
    )
    guided_compile_timeout: float = knob(
        20.0,
        unit="s",
        help="seconds a guide's grammar may take to compile before its request is refused "
        "(and the guide refused at once after that)",
    )
    guided_compile_memory: int = knob(
        1 << 30,
        unit="bytes",
        help="memory a guide's grammar compile may use (in a process of its own; over it the "
        "request is refused and the guide refused at once after that), e.g. 512Mi",
    )
    guided_cache_dir: str = knob(
        "",
        help="a directory every instance can read and write (a shared volume): each "
        "compiled grammar is left there and loaded by the other instances instead of "
        "compiled again; `pdserve up` uses its run directory; empty = off",
    )


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding, parsed by ``engine/config/speculative.py``."""

    speculative: str | None = knob(
        None,
        help='speculative decoding: "ngram:k=4[,n=4,min_n=1]" or "draft:model=PATH,k=4"; '
        "unset = off",
    )


@dataclass(frozen=True)
class LoRASettings:
    """Multi-LoRA serving (engine/lora/, docs/lora.md), vLLM's names."""

    enable_lora: bool = knob(False, help="serve LoRA adapters (also set by --lora-modules)")
    max_loras: int = knob(1, help="LoRA adapters in device slots at once")
    max_lora_rank: int = knob(16, help="largest LoRA rank served")
    max_cpu_loras: int | None = knob(
        None, help="LoRA adapters kept checked in host memory (default max-loras)"
    )
    lora_wait_timeout: float = knob(
        30.0, unit="s", help="seconds a request waits for a LoRA slot before it is refused"
    )
    lora_modules: tuple[tuple[str, str], ...] = knob(
        (),
        help="LoRA adapters (HF PEFT directories) served under these model names, as "
        "NAME=PATH; the env twin holds them separated by spaces or commas",
    )
