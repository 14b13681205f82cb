"""CUDA graphs for decode steps: one captured graph per batch-size bucket.

A decode step of a small model is dozens of short kernels per layer; launched one by one
from Python the launch gaps, not the GPU, set the step time. Capturing the whole step once
per batch-size bucket and replaying it removes them.

Contract of the captured callable ``forward(input_ids, positions, meta) -> logits``:
it must read only device tensors plus the host integers of ``meta`` that stay fixed for
the bucket (``num_reqs``, ``max_query_len`` = 1, ``max_seq_len`` = ``max_model_len``), never
synchronise with the host, and return logits ``[batch, vocab]`` for every row. The Triton
attention backend satisfies this; ``torch_ref`` does not (it reads the host copies), so
graphs are for ``attention_backend="triton"`` only. (The LoRA set returns the hidden states
instead, and the runner computes the logits after the replay: docs/lora.md.)

Rows past the live batch are padding: slot -1 (nothing written), sequence length 0
(nothing read), token 0 at position 0; their logits are discarded.

Tensor parallelism: each rank captures its own graphs, collectives (its shard's
all-reduces, the logits' all-gather) included. ``capture`` is then itself collective: every
rank calls it at the same point with the same buckets (its warm-up passes run the
collectives eagerly, so they must meet), after a warm-up collective has made NCCL's
communicator (``TPGroup.warm_up``), since creating one inside a capture fails. A replay's
collectives wait on the other ranks' replays of the same bucket: ranks choose the same
bucket because they run the same step inputs. Nothing in a replay has a deadline, so rank 0
watches the steps (``engine/executor/tp/watch.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (vLLM's spacing)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted({*sizes, max_batch_size})


@dataclass(slots=True)
class DecodeBuffers:
    """Static inputs every graph reads; a replay first copies the live step into them."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    query_start_loc: torch.Tensor  # [max_bs + 1] int32, always 0..max_bs
    seq_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_req] int32

    @classmethod
    def allocate(cls, max_bs: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=z(max_bs),
            positions=z(max_bs),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            seq_lens=z(max_bs, dtype=torch.int32),
            block_tables=z(max_bs, max_blocks, dtype=torch.int32),
        )

    def meta(self, bs: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[max_seq_len] * bs,
        )


class DecodeGraphs:
    """Capture ``forward`` per bucket (``capture()``), then ``run()`` decode steps through it."""

    def __init__(
        self,
        forward: DecodeForward,
        *,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device,
        buckets: list[int],
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.forward = forward
        self.max_model_len = max_model_len
        self.buckets = sorted(set(buckets))
        self.device = device
        self.buffers = DecodeBuffers.allocate(self.buckets[-1], max_blocks_per_req, device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # steps served by a graph (tests and logs read it)

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, all sharing one memory pool and one output
        buffer: an output per graph would hold ``sum(buckets) x vocab`` floats (13 GB at
        1,024 requests and a 49k vocabulary), where one holds ``max(buckets) x vocab``; the
        copy into it costs one pass over the logits."""
        pool = None
        shared: torch.Tensor | None = None
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):
            meta = self.buffers.meta(bs, self.max_model_len)
            ids, pos = self.buffers.input_ids[:bs], self.buffers.positions[:bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
                for _ in range(2):
                    self.forward(ids, pos, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(ids, pos, meta)
                if shared is None:  # the largest bucket's output: every graph's from now on
                    shared = out
                else:  # copied into the shared rows, so this graph's own output is freed
                    shared[:bs].copy_(out)
                del out
            self._outputs[bs] = shared[:bs]
            pool = graph.pool()
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket_for(self, num_reqs: int) -> int | None:
        """Smallest captured bucket that holds ``num_reqs`` rows, or None (run eagerly)."""
        for bs in self.buckets:
            if bs >= num_reqs and bs in self._graphs:
                return bs
        return None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay for a pure-decode step (one token per request); returns ``[num_reqs, vocab]``.

        The returned tensor is the graph's output buffer: it is overwritten by the next replay.
        """
        n = meta.num_reqs
        if meta.max_query_len != 1 or input_ids.shape[0] != n:
            raise ValueError("DecodeGraphs.run takes decode steps only (one new token per request)")
        if meta.max_seq_len > self.max_model_len:
            raise ValueError(
                f"max_seq_len {meta.max_seq_len} exceeds the captured {self.max_model_len}"
            )
        bs = self.bucket_for(n)
        if bs is None:
            raise ValueError(
                f"no captured graph holds {n} requests (largest {self.max_batch_size}); run eagerly"
            )
        b = self.buffers
        width = meta.block_tables.shape[1]
        if width > b.block_tables.shape[1]:
            raise ValueError(
                f"block table width {width} exceeds the captured {b.block_tables.shape[1]}"
            )
        b.input_ids[:n].copy_(input_ids, non_blocking=True)
        b.positions[:n].copy_(positions, non_blocking=True)
        b.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        b.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        b.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if bs > n:  # padding rows: write nothing, read nothing
            b.slot_mapping[n:bs].fill_(-1)
            b.seq_lens[n:bs].zero_()
        self._graphs[bs].replay()
        self.num_replays += 1
        return self._outputs[bs][:n]
