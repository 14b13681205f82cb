"""First-use work done before the caller's first batch (docs/design.md §3 "Offline LLM").

On CUDA the first step of each new shape pays one-off costs: Triton JIT specialisations of
the attention and fused kernels (a large prefill takes other tiles than a small one; a
mixed prefill+decode step other kernels than a graphed decode step), cuBLAS heuristics,
and the caching allocator growing to its working set. A batch that meets them first pays
seconds: ``benchmarks/README.md`` measured the same engine at 9.56k tok/s (256 × 1k/1k)
without a 256-wide warm-up pass against 12.6k with one. ``warm_up`` runs one such pass on
throwaway random prompts and then forgets their prefix blocks.
"""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WARMUP_NEW_TOKENS = 8
LONE_PROMPT_TOKENS = 512


def warmup_prompts(engine: LLMEngine, seed: int = 0) -> list[list[int]]:
    """Prompts for one pass that meets every step shape the engine has: a prefill step
    that fills ``max_num_batched_tokens``, chunked prefills next to decodes, and decode
    steps at the largest batch that fits. Ragged lengths, so token counts of every
    alignment show up. Empty when the KV pool cannot hold even one small request."""
    cfg = engine.config
    budget, block = cfg.max_num_batched_tokens, cfg.block_size
    free_tokens = engine.kv.pool.num_free_blocks * block
    room = engine.max_model_len - WARMUP_NEW_TOKENS - 1  # longest prompt the model allows
    # Keep a quarter of the pool free: preemption is not what this pass is for.
    usable = free_tokens * 3 // 4
    n = min(cfg.max_num_seqs, usable // (2 * block))
    if n < 1 or room < 2:
        return []
    # At least 2x the step budget of prompt tokens (one full-budget prefill step, then
    # chunks mixed with decodes) after the ragged cut of up to a quarter below: 8/3 budget
    # before it. Within the pool and the model length.
    want = -(-8 * budget // (3 * n))
    per = max(2, min(room, want, usable // n - WARMUP_NEW_TOKENS - block))
    rng = random.Random(seed)
    vocab = engine.args.vocab_size
    lens = [max(1, per - rng.randrange(0, max(1, per // 4))) for _ in range(n)]
    return [[rng.randrange(vocab) for _ in range(length)] for length in lens]


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up pass to completion and reset the prefix cache; returns seconds.
    The engine must be idle (no requests): its outputs are dropped."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine (requests are in flight)")
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=WARMUP_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = warmup_prompts(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    # Then one request alone with a longer prompt: a lone prefill whose query is longer
    # than any of the batch pass's short prompts is a shape of its own (on the H200 the
    # first lone 512-token prompt after the batch pass alone took 1.3 s), and batch-1
    # decode steps follow it.
    room = engine.max_model_len - WARMUP_NEW_TOKENS - 1
    free_tokens = engine.kv.pool.num_free_blocks * engine.config.block_size
    lone_len = min(LONE_PROMPT_TOKENS, room, free_tokens // 2)
    if prompts and lone_len >= 2:
        rng = random.Random(1)
        lone = [rng.randrange(engine.args.vocab_size) for _ in range(lone_len)]
        engine.add_request("warmup-lone", lone, params)
        while engine.has_unfinished():
            engine.step()
    engine.reset_prefix_cache()
    seconds = time.perf_counter() - t0
    logger.info(
        "warm-up: %d requests, %d prompt tokens, %.1f s",
        len(prompts),
        sum(map(len, prompts)),
        seconds,
    )
    return seconds
