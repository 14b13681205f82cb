"""Forward passes over made-up tokens, outside any request: the memory profile that sizes
the KV cache on CUDA, and the warm-up of the eager step shapes that no graph capture met.

Both run the model into a scratch cache of their own (never the engine's KV pool), one
sequence of ``n`` tokens at positions ``0..n-1``, and discard the output.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.models import ModelArgs

logger = logging.getLogger(__name__)


class ModelRunner(Protocol):
    """What these passes read of ``engine.executor.model_runner.ModelRunner`` (named here
    rather than imported: the runner imports this module)."""

    device: torch.device
    block_size: int
    num_layers: int
    num_kv_heads: int
    kv_dtype: torch.dtype
    max_model_len: int
    args: ModelArgs
    config: EngineConfig
    model: Any
    stage: Any


def dummy_forward(runner: ModelRunner, n: int) -> None:
    """One prefill of ``n`` tokens through the model (and the LM head on the last stage)."""
    device, block = runner.device, runner.block_size
    num_blocks = -(-n // block)
    cache = torch.zeros(
        (
            runner.num_layers,
            runner.args.kv_planes,
            2 + num_blocks,
            block,
            runner.num_kv_heads,
            runner.args.kv_head_dim,
        ),
        dtype=runner.kv_dtype,
        device=device,
    )
    ids = torch.zeros(n, dtype=torch.long, device=device)
    pos = torch.arange(n, device=device)
    blocks = torch.arange(1, 1 + num_blocks, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=pos + block,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=blocks[None],
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    with torch.inference_mode():
        hidden = runner.model(ids, pos, cache, meta)
        if runner.stage.is_last:
            runner.model.compute_logits(hidden[-1:])
    del cache, hidden


def cuda_kv_budget(runner: ModelRunner) -> int:
    """Bytes left for KV after the weights and a forward pass at the full token budget."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    dummy_forward(runner, min(runner.config.max_num_batched_tokens, runner.max_model_len))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * runner.config.gpu_memory_utilization) - peak


def eager_warm_up_sizes(max_batched_tokens: int, max_model_len: int, graph_max: int) -> list[int]:
    """Token counts of one-sequence steps that compile, before serving, the kernel variants
    eager steps need and the captures never made: Triton specializes an integer argument
    on being divisible by 16, and the graphs' token counts all are, so a small odd count;
    and, when steps may be larger than the largest mixed graph, an odd count past it (the
    attention tiles chosen for longer queries)."""
    sizes = [17]
    longest = min(max_batched_tokens, max_model_len)
    if longest > graph_max + 1:
        sizes.append(longest - 1 if longest % 2 == 0 else longest)
    return [n for n in sizes if n <= longest]


def warm_up_eager_shapes(runner: ModelRunner, graph_max: int) -> None:
    """Run ``eager_warm_up_sizes`` once, so the first live step of such a shape does not
    wait for Triton to compile (seen as a 2 s TTFT tail on an H100 with an 8,192-token
    budget); the time goes to the start instead."""
    sizes = eager_warm_up_sizes(
        runner.config.max_num_batched_tokens, runner.max_model_len, graph_max
    )
    for n in sizes:
        dummy_forward(runner, n)
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    logger.info("warmed up eager steps of %s tokens", sizes)
