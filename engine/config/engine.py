"""Engine configuration: one frozen object, validated once, read everywhere."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.memory_budget import EngineMemory, check_host, host_memory_bytes
from engine.config.deterministic import check_deterministic
from engine.config.lora import check_lora_settings
from engine.config.pipeline import check_pipeline_settings
from engine.config.speculative import SpeculativeConfig, parse_speculative

if TYPE_CHECKING:
    from engine.models.fp8_loader import Fp8Scheme

KV_LAYOUT_VERSION = 1
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("fcfs", "priority")
_KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to build itself. ``validate()`` runs in ``__post_init__``.

    ``model`` is a local Hugging Face directory (or "smollm2", resolved by the caller).
    ``kv_cache_memory`` sizes the block pool on the CPU; ``gpu_memory_utilization`` on CUDA.
    ``num_kv_blocks`` overrides both (tests use it to force preemption).
    ``tensor_parallel_size`` > 1 shards the model over that many processes (one per GPU
    on CUDA; engine/executor/); ``distributed_timeout`` bounds every wait between them.
    ``pipeline_parallel_size`` P > 1 splits the layers into P stages, each of
    ``tensor_parallel_size`` processes (engine/executor/pp/; docs/design.md §3).
    """

    model: str
    dtype: str = "auto"
    # KV cache storage: "auto" = the model dtype, "fp8" = float8_e4m3fn with per-tensor
    # scales (engine/attention/kv_quant.py; docs/design.md §3 "KV cache dtype").
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config)
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # "auto" | "torch_ref" | "triton" | "flash_attn" (engine/attention/__init__.py)
    attention_backend: str = "auto"
    seed: int = 0
    kv_load_failure: str = "recompute"  # "recompute" | "fail"
    # Guided-decoding budget (engine/sampling/guided.py): a guide's text at most this many
    # bytes, and its grammar compiled within this many seconds, else the request is refused.
    guided_max_bytes: int = 256 * 1024
    guided_compile_timeout: float = 20.0
    guided_compile_memory: int = 1 << 30  # address space a compile may add (its own process)
    guided_cache_dir: str = ""  # compiled grammars shared by instances; "" = off
    cuda_graphs: bool = True  # capture decode steps on CUDA (triton, flash_attn, auto)
    # Steps that carry prefill chunks replay full graphs over padded token counts up to
    # ``mixed_graph_max_tokens`` (0 = eager) when ``cuda_graphs`` is on and the attention
    # backend is Triton (engine/executor/mixed_graphs.py; docs/design.md §3 "CUDA graphs").
    mixed_cuda_graphs: bool = True
    mixed_graph_max_tokens: int = 2048
    # FP8 models on CUDA with the Triton layer ops: quantize each projection's input inside
    # the RMSNorm / SiLU·mul kernel that makes it (engine/models/triton_fp8_fused.py; the
    # same bytes, a launch fewer per projection). Off until measured on the GPU kinds.
    fp8_fused_quant: bool = False
    fused_ops: bool = True  # Triton RMSNorm/rope/SiLU kernels on CUDA (engine/models/layer_ops.py)
    # Launch decode step n+1 before step n's tokens reach the host (engine/step/async_scheduling.py).
    # None: on for CUDA, where the host time it hides is a tenth of a small model's step.
    async_scheduling: bool | None = None
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding: None, "ngram:k=4" or "draft:model=PATH,k=4" (engine/config/speculative.py).
    speculative: str | None = None
    tensor_parallel_size: int = 1
    # Pipeline parallelism (vLLM's name): P contiguous stages of layers, a P x N grid of
    # processes. ``pipeline_inflight_batches``: keep up to P batches in flight so every
    # stage works at once (off: one batch at a time, the bubble; engine/step/pp_batches.py).
    pipeline_parallel_size: int = 1
    pipeline_inflight_batches: bool = True
    # ``pipeline_leader`` "HOST:PORT" spreads the stages over hosts (one pod per stage on
    # Kubernetes, docs/kubernetes.md): this process runs stage ``pipeline_stage`` only,
    # stage 0 hosts the rendezvous on PORT and the others dial it. Empty: every stage here.
    pipeline_stage: int = 0
    pipeline_leader: str = ""
    # Seconds a collective between tensor-parallel ranks (or a rank's start-up) may take
    # before the step fails: a rank that died or hangs fails the engine instead of hanging it.
    distributed_timeout: float = 300.0
    # "fp8": e4m3 decoder projections quantized at load (engine/models/fp8.py). An FP8
    # (compressed-tensors) checkpoint is FP8 with or without it.
    quantization: str | None = None
    # Multi-LoRA serving (engine/lora/, docs/lora.md), vLLM's names: adapters resident in
    # device slots at once, their largest rank, adapters kept checked in host memory
    # (None: max_loras), how long a request waits for a slot, adapters known at start.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_wait_timeout: float = 30.0
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Batch-invariant kernels: a row's result does not depend on the batch around it
    # (engine/config/deterministic.py; docs/design.md §3 "Deterministic mode").
    deterministic: bool = False
    # Record prefix-cache events for subscribers (docs/design.md §3 "KV events"); the
    # services turn it on, offline use has no one to read them.
    kv_events: bool = False
    # Batches a subscriber may fall behind before it is cut off (it then resubscribes).
    kv_events_max_queue: int = 1024
    # Bytes of host memory (pinned on CUDA) that keep blocks the device cache evicts;
    # 0 = no host tier (engine/kv/host_tier.py).
    kv_offloading_size: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not os.path.isdir(self.model):
            raise ValueError(
                f"model: {self.model!r} is not a directory; give a local Hugging Face model "
                "directory (or resolve 'smollm2' with common.models.resolve_model first)"
            )
        if self.load_format == "auto" and not _has_weights(self.model):
            raise ValueError(
                f"model: no *.safetensors files in {self.model!r} (or use load_format='dummy')"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.mixed_graph_max_tokens < 0:
            raise ValueError(
                f"mixed_graph_max_tokens must be >= 0, got {self.mixed_graph_max_tokens}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.kv_load_failure not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure must be 'recompute' or 'fail', got {self.kv_load_failure!r}"
            )
        if self.guided_max_bytes < 1 or self.guided_compile_timeout <= 0:
            raise ValueError("guided_max_bytes must be >= 1 and guided_compile_timeout > 0")
        if self.guided_compile_memory < 16 << 20:
            raise ValueError(
                f"guided_compile_memory must be >= 16Mi, got {self.guided_compile_memory}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.speculative is not None:
            self.speculative_config()  # raises ValueError with the accepted forms
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        check_pipeline_settings(
            self.pipeline_parallel_size, self.pipeline_stage, self.pipeline_leader
        )
        if self.pipeline_parallel_size != 1:
            self._check_pipeline()
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 s, got {self.distributed_timeout}")
        scheme = self.quantization_scheme()  # raises ValueError naming what is supported
        from engine.models.config import ModelArgs
        from engine.models.support import check_combination, check_mla_settings

        fp8_checkpoint = scheme is not None and scheme.from_checkpoint
        if fp8_checkpoint or self.device != "cpu":  # the only cases it refuses
            check_combination(ModelArgs.from_hf(self.hf_config()), fp8_checkpoint, self.device)
        check_lora_settings(self)
        check_mla_settings(self)
        if self.deterministic:
            check_deterministic(self, scheme is not None)
        self._check_host_tier()
        if self.tensor_parallel_size > 1:
            from engine.models.parallel import check_tensor_parallel

            check_tensor_parallel(ModelArgs.from_hf(self.hf_config()), self.tensor_parallel_size)

    def _check_host_tier(self) -> None:
        # Host memory promised against the machine's (common/memory_budget.py): a clear
        # error at start, not an allocator traceback (64Ti) or a later out-of-memory.
        kv = self.kv_cache_memory if self.num_kv_blocks is None else 0
        memory = EngineMemory(self.device, kv, max(self.kv_offloading_size, 0))
        check_host([memory], host_memory_bytes(), "this machine")
        if self.kv_events_max_queue < 1:
            raise ValueError(f"kv_events_max_queue must be >= 1, got {self.kv_events_max_queue}")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0, got {self.kv_offloading_size}")
        if not self.kv_offloading_size:
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs the prefix cache (drop --no-prefix-caching)")
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError(
                "kv_offloading_size (the host KV tier) works with tensor_parallel_size and "
                f"pipeline_parallel_size 1 only; got {self.tensor_parallel_size} and "
                f"{self.pipeline_parallel_size}"
            )

    def _check_pipeline(self) -> None:
        """``ValueError`` for a ``pipeline_parallel_size`` the model or the other settings
        cannot run (before any process starts)."""
        from engine.models.config import ModelArgs
        from engine.models.stages import check_pipeline_parallel

        args = ModelArgs.from_hf(self.hf_config())
        check_pipeline_parallel(args.num_layers, self.pipeline_parallel_size)
        if self.enable_lora:
            raise ValueError("enable_lora with pipeline_parallel_size > 1 is not supported")

    @property
    def inflight_batches(self) -> int:
        """How many batches the engine keeps in flight through the stages: P, or 1 when
        ``pipeline_inflight_batches`` is off or a step's drafts need the newest tokens
        (speculative decoding runs its pipeline one batch at a time)."""
        if not self.pipeline_inflight_batches or self.speculative is not None:
            return 1
        return self.pipeline_parallel_size

    def quantization_scheme(self) -> Fp8Scheme | None:
        """The FP8 scheme from ``quantization`` and the checkpoint's config (None: none)."""
        from engine.models.fp8_loader import resolve_quantization

        return resolve_quantization(self.quantization, self.hf_config())

    def speculative_config(self) -> SpeculativeConfig | None:
        """The parsed ``speculative`` setting (None when off)."""
        return None if self.speculative is None else parse_speculative(self.speculative)

    @property
    def async_scheduling_on(self) -> bool:
        """``async_scheduling`` resolved; never with speculative decoding (a draft step
        needs the host to know the newest token) nor with pipeline stages."""
        if self.speculative is not None or self.pipeline_parallel_size > 1:
            return False  # stages: in-flight batches keep them busy instead
        return self.device != "cpu" if self.async_scheduling is None else self.async_scheduling

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.device != "cpu":
            return "bfloat16"
        # float32 unless the CPU has native bf16 and bf16's measured greedy agreement with
        # float32 is high enough (docs/design.md §3 "CPU dtype").
        from engine.attention.cpu_kernels import auto_cpu_dtype

        return auto_cpu_dtype()

    @property
    def kv_cache_dtype_name(self) -> str:
        """The torch dtype name the paged KV cache stores (what KV records and handles
        carry as ``dtype``): the model dtype, or ``float8_e4m3fn`` for ``fp8``."""
        return "float8_e4m3fn" if self.kv_cache_dtype == "fp8" else self.torch_dtype_name

    def hf_config(self) -> dict[str, Any]:
        """The model directory's config.json with ``hf_overrides`` applied."""
        with open(os.path.join(self.model, "config.json"), encoding="utf-8") as f:
            cfg: dict[str, Any] = json.load(f)
        cfg.update(self.hf_overrides)
        return cfg


def _has_weights(model_dir: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(model_dir))
