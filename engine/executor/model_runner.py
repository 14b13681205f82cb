"""The model runner owns the device tensors: weights, the paged KV cache, step inputs.

Each step it flattens the scheduled requests' new tokens into one "super sequence" with
positions, slot mapping and attention metadata, runs the model once, and returns the
logits of each request's last scheduled position.

Under tensor parallelism every rank has a runner holding its shard of the model and a
paged KV cache of its own KV heads (same blocks, same block ids on every rank); rank 0's
executor (``engine/executor/``) builds the step's host inputs and hands them to the
others, and every rank runs ``run`` on them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from engine.attention import get_backend
from engine.attention.base import AttentionMetadata
from engine.attention.kv_quant import FP8_DTYPE
from engine.config import EngineConfig
from engine.core.scheduler import ScheduledRequest
from engine.distributed.pp_group import PPGroup
from engine.distributed.tp_group import TPGroup
from engine.executor.cuda_graphs import DecodeGraphs, default_buckets
from engine.executor.dummy_forward import cuda_kv_budget, warm_up_eager_shapes
from engine.executor.mixed_graphs import MixedGraphs, mixed_buckets
from engine.executor.step_inputs import HostInputs, InputBuilder, StepInputs
from engine.lora.slots import LoRASlots, attach
from engine.models import ModelArgs, build_model
from engine.models.parallel import Shard
from engine.models.stages import Stage

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        args: ModelArgs,
        max_model_len: int,
        tp: TPGroup | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        """``tp``: this rank's tensor-parallel group (None: the whole model here). ``pp``:
        the pipeline grid this rank is in (None: one stage); the runner then holds its
        stage's layers and their KV only. Every rank constructs its runner at the same
        time: sizing the KV pool is collective."""
        self.config = config
        self.args = args
        self.tp = tp or TPGroup.single()
        self.pp = pp
        self.stage = (
            Stage(pp.stage, pp.pp_size, args.num_layers)
            if pp is not None
            else Stage.whole(args.num_layers)
        )
        # This stage's layers: the KV cache's first dimension (docs/design.md §3
        # "Pipeline parallelism": stage s's index i is the model's layer first + i).
        self.num_layers = len(self.stage.layers)
        self.num_kv_heads = Shard(args, self.tp.rank, self.tp.size).num_kv_heads
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.torch_dtype_name]
        # The paged cache's storage dtype: the model dtype, or float8 e4m3 for
        # kv_cache_dtype "fp8" (engine/attention/kv_quant.py); blocks are sized by it.
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else self.dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend(
            config.attention_backend, config.device, deterministic=config.deterministic
        )
        self.model = build_model(
            args,
            config.model,
            config.load_format,
            self.backend,
            max_model_len,
            self.dtype,
            config.device,
            config.seed,
            fused_ops=config.fused_ops,
            tp=self.tp if self.tp.size > 1 else None,
            quantization=config.quantization_scheme(),
            deterministic=config.deterministic,
            stage=self.stage if self.stage.size > 1 else None,
        )
        if config.fp8_fused_quant and config.quantization_scheme() is not None:
            # The FP8 projections' inputs quantized inside the norm and SiLU kernels.
            enable = getattr(self.model, "enable_fp8_fusions", None)
            if enable is None or not enable():
                logger.info("fp8_fused_quant: not for this model / these layer ops; unfused")
        self.num_blocks = self._size_kv_cache()
        if self.tp.size > 1:
            # Block ids mean the same blocks on every rank: the pool is the smallest one.
            self.num_blocks = self.tp.min_int(self.num_blocks)
        if self.pp is not None:  # and on every stage
            self.num_blocks = self.pp.min_int(self.num_blocks)
        self.kv_cache = torch.zeros(
            (
                self.num_layers,
                args.kv_planes,  # K and V, or MLA's one latent (docs/design.md §3)
                self.num_blocks,
                self.block_size,
                self.num_kv_heads,
                args.kv_head_dim,
            ),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        self._inputs = InputBuilder(self.device, self.block_size, self.max_blocks_per_req)
        if self.tp.size > 1:
            # Every rank, here: NCCL's communicator must exist before graphs capture its
            # collectives; on the CPU it checks the gloo group the same way.
            self.tp.warm_up(self.device)
        # The step's LoRA token slots, when LoRA is on (``bind_lora``), and the graphs
        # recorded with the LoRA kernels, which steps with adapter tokens replay.
        self.lora_slots: LoRASlots | None = None
        self.lora_graphs: DecodeGraphs | None = None
        self.lora_mixed_graphs: MixedGraphs | None = None
        if self.device.type == "cuda" and self.stage.size == 1:
            # the kernels of eager steps no capture compiles (dummy_forward.py), run before
            # the captures: the memory profile left exactly this forward's room
            mixed = self.config.cuda_graphs and self.config.mixed_cuda_graphs
            warm_up_eager_shapes(self, self.config.mixed_graph_max_tokens if mixed else 0)
        self.graphs = self._capture_decode_graphs()
        self.mixed_graphs = self._capture_mixed_graphs()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s), attention backend %s",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            self.backend.name,
        )

    def release(self) -> None:
        """Give back the weights, the KV pool and the decode graphs (engine shutdown).

        Dropping the engine is not enough: the runner is in a reference cycle (its decode
        graphs' forward closes over it) and the engine's ``gc.freeze()`` at start-up moved
        that cycle where the collector never looks. On the H200 a shut-down engine so kept
        its 0.9 of the GPU, and a second engine in the same process (a benchmark's second
        mode, the next GPU test) ran out of memory. The runner is unusable afterwards."""
        if not hasattr(self, "model"):
            return  # released already
        self.graphs = self.mixed_graphs = None
        self.lora_graphs = self.lora_mixed_graphs = None
        self.kv_cache = torch.empty(0, dtype=self.kv_dtype, device=self.device)
        del self.model  # the weights go with the last reference to the module
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def bind_lora(self, slots: LoRASlots) -> None:
        """Serve LoRA (engine/lora_serving.py): every layer adds the step's LoRA terms
        from ``slots``. Where base-model steps replay CUDA graphs and the slots' kernels
        read only device data, a second set of graphs is recorded with the LoRA kernels
        in (docs/lora.md): steps with adapter tokens replay those, base-model steps keep
        the graphs without them (no LoRA launch at all)."""
        attach(self.model, slots)
        self.lora_slots = slots
        if not slots.graphable or (self.graphs is None and self.mixed_graphs is None):
            return
        with slots.recording():
            if self.graphs is not None:
                # Hidden states out, logits eagerly after the replay: no second set of
                # per-bucket logits buffers (2 GB at 256 sequences and a 128k vocabulary).
                self.lora_graphs = self._capture_decode_graphs(logits=False)
            if self.mixed_graphs is not None:
                # One memory pool for both sets: a mixed graph's allocations end with
                # its replay (engine/executor/mixed_graphs.py).
                self.lora_mixed_graphs = self._capture_mixed_graphs(self.mixed_graphs.pool)

    def _capture_decode_graphs(self, logits: bool = True) -> DecodeGraphs | None:
        """CUDA graphs for pure-decode steps (one per batch-size bucket). They need a
        backend that reads only device tensors: ``triton``, or one with
        ``captures_decode`` (engine/attention/base.py: flash_attn, auto).

        Under tensor parallelism every rank captures its own graphs, with its shard's
        all-reduces and the logits' all-gather inside, from the same config and so the
        same buckets in the same order (the capture's warm-up passes are collectives).
        Ranks replay in step because each runs ``run`` on the same step inputs, and the
        graph choice depends only on them."""
        if (
            self.device.type != "cuda"
            # triton, or a backend whose decode steps are Triton's (flash_attn, auto)
            or not (self.backend.name == "triton" or self.backend.captures_decode)
            or not self.config.cuda_graphs
            # a stage's step sends and receives between graphs: eager (left for GPUs)
            or self.stage.size > 1
        ):
            return None

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            hidden = self.model(ids, pos, self.kv_cache, meta)
            return self.model.compute_logits(hidden) if logits else hidden

        graphs = DecodeGraphs(
            forward,
            max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            device=self.device,
            buckets=default_buckets(self.config.max_num_seqs),
        )
        graphs.capture()
        return graphs

    def _capture_mixed_graphs(self, pool: Any = None) -> MixedGraphs | None:
        """Full CUDA graphs for steps with prefill chunks, one per padded token count up
        to ``mixed_graph_max_tokens`` (engine/executor/mixed_graphs.py). Only a backend
        with ``captures_mixed`` (Triton: lengths as device data) qualifies; like the
        decode graphs, every tensor-parallel rank captures the same buckets in order."""
        buckets = mixed_buckets(
            min(self.config.mixed_graph_max_tokens, self.config.max_num_batched_tokens)
        )
        if (
            self.device.type != "cuda"
            or not self.backend.captures_mixed
            or not (self.config.cuda_graphs and self.config.mixed_cuda_graphs)
            or self.stage.size > 1
            or not buckets
            # MLA's prefill chunks go request by request on host lengths (engine/models/mla.py)
            or self.args.mla is not None
        ):
            return None
        graphs = MixedGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_cache, meta),
            buckets=buckets,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_blocks_per_req=self.max_blocks_per_req,
            hidden_size=self.args.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        graphs.capture(pool)
        return graphs

    def bytes_per_block(self) -> int:
        a = self.args
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        per_token = a.kv_planes * self.num_kv_heads * a.kv_head_dim * elem
        return self.block_size * per_token * self.num_layers

    def _size_kv_cache(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.bytes_per_block()
        on_cuda = self.device.type == "cuda"
        budget = cuda_kv_budget(self) if on_cuda else self.config.kv_cache_memory
        blocks = budget // per_block
        if blocks < 2:
            raise ValueError(
                f"KV cache budget {budget} bytes holds {blocks} blocks of {per_block} bytes; "
                "raise kv_cache_memory / gpu_memory_utilization"
            )
        return int(blocks)

    def prepare(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> StepInputs:
        """Flatten the step's new tokens (see the module docstring) into device tensors."""
        return self._inputs.build(scheduled, input_ids)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(scheduled), vocab]`` — or, when some
        requests carry drafts, ``1 + len(spec_token_ids)`` rows per request (its last
        positions, in order), request after request. ``input_ids`` on the device replace
        the requests' token ids (async scheduling: the previous step's sampled tokens)."""
        if self.lora_slots is not None:
            self.lora_slots.set_batch(token_slots(scheduled))
        return self.run(self.prepare(scheduled, input_ids))

    def prepare_host(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> HostInputs:
        """The host half of ``prepare`` (what rank 0 sends the other ranks)."""
        return self._inputs.host(scheduled, input_ids)

    def to_device(self, host: HostInputs, input_ids: torch.Tensor | None = None) -> StepInputs:
        """The device half of ``prepare``."""
        return self._inputs.to_device(host, input_ids)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass of a prepared step; logits as ``execute`` says."""
        graphs, mixed = self.graphs, self.mixed_graphs
        slots = self.lora_slots
        if slots is not None and slots.active:
            # Steps with adapter tokens replay the graphs recorded with the LoRA kernels
            # (``bind_lora``); none with the torch path (CPU): eager.
            ok = slots.graphable
            graphs = self.lora_graphs if ok else None
            mixed = self.lora_mixed_graphs if ok else None
        if (
            graphs is not None
            and inputs.meta.max_query_len == 1
            and graphs.bucket_for(inputs.meta.num_reqs)
        ):
            out = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            if graphs is self.lora_graphs:  # hidden states (``bind_lora``)
                return self.model.compute_logits(out[inputs.logits_indices])
            return out
        if mixed is not None and mixed.bucket_for(inputs.input_ids.shape[0], inputs.meta.num_reqs):
            # A step with prefill chunks (or drafts), or a decode step no decode graph holds.
            hidden = mixed.run(inputs.input_ids, inputs.positions, inputs.meta)
            return self.model.compute_logits(hidden[inputs.logits_indices])
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def run_stage(self, inputs: StepInputs, carried: torch.Tensor | None) -> torch.Tensor:
        """This pipeline stage's part of a prepared step: from the step's ids (first stage)
        or ``carried`` (the previous stage's ``[2, tokens, hidden]``), through this stage's
        layers, to the logits (last stage; as ``run``) or the pair for the next stage."""
        out = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, carried)
        if not self.stage.is_last:
            return out
        return self.model.compute_logits(out[inputs.logits_indices])


def token_slots(scheduled: list[ScheduledRequest]) -> np.ndarray:
    """The step's slot per flattened token (-1: base model), in the runner's token order."""
    slots = np.fromiter((s.request.lora_slot for s in scheduled), np.int32, len(scheduled))
    counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
    return np.repeat(slots, counts)
