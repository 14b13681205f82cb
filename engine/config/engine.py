"""Engine configuration: one frozen object, validated once, read everywhere."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.memory_budget import EngineMemory, check_host, host_memory_bytes
from engine.config.deterministic import check_deterministic
from engine.config.lora import check_lora_settings
from engine.config.parts import (
    CacheSettings,
    GuidedSettings,
    KernelSettings,
    LoRASettings,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    SpeculativeSettings,
    check_choices,
)
from engine.config.pipeline import check_pipeline_settings
from engine.config.speculative import SpeculativeConfig, parse_speculative

if TYPE_CHECKING:
    from engine.models.fp8_loader import Fp8Scheme

KV_LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class EngineConfig(
    LoRASettings,
    SpeculativeSettings,
    GuidedSettings,
    ParallelSettings,
    KernelSettings,
    SchedulerSettings,
    CacheSettings,
    ModelSettings,
):
    """Everything the engine needs to build itself, composed of the typed parts of
    ``engine/config/parts.py`` (each setting's default, choices and help declared once
    there; ``model`` comes first). ``validate()`` runs in ``__post_init__``."""

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
        check_choices(self)  # dtype, load_format, scheduling_policy, ... (parts.py)
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

        return resolve_quantization(self.quantization, self.hf_config(), self.fp8_scales)

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
