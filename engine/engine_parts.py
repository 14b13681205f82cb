"""``build_engine_parts``: the engine's collaborators, built in the order they depend on each
other, so that ``LLMEngine`` is its step loop and nothing else (docs/design.md §3 "The step").

The order is the contract: the executor builds the model and sizes the KV pool; the block
manager, LoRA slots and the scheduler sit on that pool; the connector's worker side binds the
pool once it exists; the step's parts come last since they drive the scheduler and the
executor together: the post-processing (``StepOutputs``), the step runner chosen once here
(synchronous, async scheduling or batches in flight) and the ordered per-step hooks
(docs/design.md §3 "The step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.detokenizer import load_tokenizer
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import KvEventLog
from engine.core.request_limits import RequestLimits
from engine.core.scheduler import Scheduler
from engine.executor import make_executor
from engine.executor.base import Executor
from engine.executor.model_runner import ModelRunner
from engine.kv.fingerprint import KvLayout, kv_layout, model_fingerprint
from engine.kv.host_tier import HostKvTier, build_kv_cache
from engine.kv.transfers import KVTransferCoordinator, kv_worker
from engine.lora_serving import LoRAServing
from engine.models import ModelArgs
from engine.sampling.guided import GuidedDecoding
from engine.sampling.sampler import Sampler
from engine.spec_decode.decoder import SpecDecoder
from engine.step.async_scheduling import StepPipeline
from engine.step.hooks import StepHook, step_hooks
from engine.step.output_processor import OutputProcessor
from engine.step.outputs import StepOutputs
from engine.step.pp_batches import InflightBatches
from engine.step.runners import StepRunner, step_runner
from kv_store.base import KVConnector


@dataclass(slots=True)
class EngineParts:
    """What one engine is made of; ``LLMEngine`` keeps each part as an attribute."""

    args: ModelArgs
    max_model_len: int
    tokenizer: Any  # a Hugging Face tokenizer, or None for a bare config
    eos_token_ids: frozenset[int]
    executor: Executor  # runs the model: here, or over tensor/pipeline-parallel workers
    runner: ModelRunner  # this process's runner (rank 0's shard)
    kv: KVCacheManager  # block tables and prefix cache
    kv_events: KvEventLog | None
    host_tier: HostKvTier | None
    lora: LoRAServing | None
    scheduler: Scheduler
    sampler: Sampler
    guided: GuidedDecoding
    spec: SpecDecoder | None
    model_fingerprint: str
    kv_layout: KvLayout
    transfers: KVTransferCoordinator | None  # the connector's worker side, when one is given
    limits: RequestLimits
    outputs: OutputProcessor
    pipeline: StepPipeline | None  # async scheduling
    batches: InflightBatches | None  # pipeline stages: up to P batches in flight
    post: StepOutputs  # a step's logits into outputs; the ends of requests
    steps: StepRunner  # how a step is launched and finished (one of three, chosen here)
    hooks: list[StepHook]  # the per-step extras, in order


def build_engine_parts(config: EngineConfig, connector: KVConnector | None) -> EngineParts:
    """Every collaborator of an engine for ``config``; on failure nothing is left running."""
    args = ModelArgs.from_hf(config.hf_config())
    max_model_len = args.max_model_len(config.max_model_len)
    tokenizer = load_tokenizer(config.model)
    eos_token_ids = frozenset(args.eos_token_ids)
    if connector is not None:  # refused before any rank starts
        # Every process of the P x N grid moves its own KV (docs/design.md §3).
        connector.check_ranks(config.tensor_parallel_size * config.pipeline_parallel_size)
    executor = make_executor(config, args, max_model_len)
    try:
        return _build_on(config, connector, args, max_model_len, tokenizer, eos_token_ids, executor)
    except Exception:
        executor.shutdown()  # no worker outlives a failed start
        raise


def _build_on(
    config: EngineConfig,
    connector: KVConnector | None,
    args: ModelArgs,
    max_model_len: int,
    tokenizer: Any,
    eos_token_ids: frozenset[int],
    executor: Executor,
) -> EngineParts:
    runner = executor.runner
    # Blocks outside every layer's window are released as requests advance; not when a
    # connector may still save or hold a request's prompt blocks (kept whole there).
    window = args.max_window if connector is None else 0
    kv, kv_events, host_tier = build_kv_cache(config, runner, window)
    lora = LoRAServing(config, args, runner) if config.enable_lora else None
    scheduler = Scheduler(config, kv, lora.manager if lora else None)
    guided = GuidedDecoding.for_engine(tokenizer, args.vocab_size, sorted(eos_token_ids), config)
    spec_config = config.speculative_config()
    spec = (
        None
        if spec_config is None
        else SpecDecoder(config, spec_config, args, max_model_len, runner.num_blocks, tokenizer)
    )
    fingerprint = model_fingerprint(config)
    layout = kv_layout(config, args, runner.num_kv_heads)
    transfers = None
    if connector is not None:
        # The connector is the scheduler side; bytes move via its worker side (docs/design.md §3).
        worker = kv_worker(connector, config, executor)
        worker.bind_kv_cache(runner.kv_cache, layout, fingerprint)
        transfers = KVTransferCoordinator(worker, kv, config.kv_load_failure)
    limits = RequestLimits(
        max_model_len, args.vocab_size, config.block_size, kv.pool.num_usable_blocks,
        connector is not None,
    )  # fmt: skip
    sampler = Sampler()
    pipeline = (
        StepPipeline(scheduler, executor, sampler, max_model_len)
        if config.async_scheduling_on
        else None
    )
    depth = config.inflight_batches
    batches = InflightBatches(scheduler, executor, depth) if depth > 1 else None  # type: ignore[arg-type]
    outputs = OutputProcessor(tokenizer, guided, max_model_len)
    post = StepOutputs(scheduler, outputs, sampler, guided, spec, transfers)
    return EngineParts(
        args=args, max_model_len=max_model_len, tokenizer=tokenizer,
        eos_token_ids=eos_token_ids, executor=executor, runner=runner, kv=kv,
        kv_events=kv_events, host_tier=host_tier, lora=lora, scheduler=scheduler,
        sampler=sampler, guided=guided, spec=spec, model_fingerprint=fingerprint,
        kv_layout=layout, transfers=transfers, limits=limits,
        outputs=outputs, pipeline=pipeline, batches=batches, post=post,
        steps=step_runner(scheduler, executor, post, pipeline, batches),
        hooks=step_hooks(post, outputs, lora),
    )  # fmt: skip
