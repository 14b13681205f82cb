"""CUDA graphs for steps that carry prefill chunks: one full graph per padded token count.

A step with a prefill chunk beside decodes (the shape most steps take under real traffic)
was launched kernel by kernel: at a few hundred tokens an 8B model's ~400 launches cost a
tenth of the step. The Triton attention backend reads the step's lengths only as device
data (``query_start_loc``, ``seq_lens``, ``block_tables``) and its grid only from the
token and request counts, so one graph per *padded* token count covers every mix of chunk
and decode lengths: the whole forward, attention included, replays from static buffers
(docs/design.md §3 "CUDA graphs").

Padding of a bucket of ``T`` tokens and ``R`` request rows (``R`` = ``min(T,
max_num_seqs) + 1``) for a live step of ``n`` tokens and ``r`` requests:
* tokens ``n..T`` write nothing (slot -1) and belong to one padding request, row ``r``,
  with ``seq_len`` 0: its programs read no KV and store zeros, so every padded row is
  finite (row-wise projections, per-token FP8 scales and MoE routing never mix rows);
* rows ``r+1..R`` are empty requests (``query_start_loc`` = T): their programs exit.

The captured callable returns the hidden states ``[T, hidden]``; the graph copies them
into one static buffer (no per-bucket output stays alive in the pool), and the caller
computes the logits of the rows it needs eagerly (their count varies with drafts and
prompt logprobs).

Capture and replay go through ``Capture`` objects: ``CudaCapture`` on the GPU,
``EagerCapture`` (runs the callable again at each replay) wherever CUDA graphs cannot run,
so the buckets, padding and buffer bookkeeping are tested on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

HiddenForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# Bucket spacing by token count: (up to, step). Fine where a padded token costs GEMM
# time (compute-bound above ~256 tokens on an 8B model) and the graph saves a larger share.
_LADDER = ((256, 16), (1024, 32), (2048, 64), (4096, 128))
MIN_TOKENS = 16  # smaller steps with a chunk are rare; they run eagerly


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: every 16 up to 256, 32 up to 1024, 64 up to 2048, 128
    up to 4096, 256 beyond, and ``max_tokens`` itself; none when it is below 16."""
    if max_tokens < MIN_TOKENS:
        return []
    sizes: list[int] = []
    t = 0
    for hi, step in (*_LADDER, (max_tokens, 256)):
        while t + step <= min(hi, max_tokens):
            t += step
            sizes.append(t)
    return sorted({*sizes, max_tokens})


class Capture(Protocol):
    """One captured step: ``capture(fn, pool)`` records ``fn`` (returns the pool it used),
    ``replay()`` runs the recording."""

    def capture(self, fn: Callable[[], None], pool: Any) -> Any: ...

    def replay(self) -> None: ...


class CudaCapture:
    """A ``torch.cuda.CUDAGraph`` of ``fn`` after two warm-up calls on a side stream
    (Triton compiles, cuBLAS picks its kernels, outside the recording)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None], pool: Any) -> Any:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=pool):
            fn()
        return self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class EagerCapture:
    """Stands in for a graph where none can be captured: ``replay`` calls ``fn`` again,
    reading the same static buffers a graph would (the CPU tests of the bookkeeping)."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None], pool: Any) -> Any:
        fn()
        self.fn = fn
        return pool

    def replay(self) -> None:
        assert self.fn is not None, "replay before capture"
        self.fn()


@dataclass(slots=True)
class MixedBuffers:
    """The static inputs every mixed graph reads, and the hidden states it writes."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    query_start_loc: torch.Tensor  # [max_rows + 1] int32
    seq_lens: torch.Tensor  # [max_rows] int32
    block_tables: torch.Tensor  # [max_rows, max_blocks_per_req] int32
    hidden: torch.Tensor  # [max_tokens, hidden_size] model dtype

    @classmethod
    def allocate(
        cls,
        max_tokens: int,
        max_rows: int,
        max_blocks: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> MixedBuffers:
        def z(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            input_ids=z(max_tokens),
            positions=z(max_tokens),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=z(max_rows + 1, dt=torch.int32),
            seq_lens=z(max_rows, dt=torch.int32),
            block_tables=z(max_rows, max_blocks, dt=torch.int32),
            hidden=z(max_tokens, hidden_size, dt=dtype),
        )

    def meta(self, tokens: int, rows: int, max_seq_len: int) -> AttentionMetadata:
        """The bucket's metadata: device views of the buffers; the host integers fixed
        (``max_query_len`` = tokens picks the attention's varlen tiles for every replay)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_query_len=tokens,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=[0] + [tokens] * rows,
            seq_lens_cpu=[0] * rows,
        )

    def pad_only(self, tokens: int, rows: int) -> None:
        """Every row padding: what the buffers hold while a bucket is captured."""
        self.slot_mapping[:tokens].fill_(-1)
        self.query_start_loc[0] = 0
        self.query_start_loc[1 : rows + 1].fill_(tokens)
        self.seq_lens[:rows].zero_()

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        tokens: int,
        rows: int,
    ) -> None:
        """Copy a live step into the buffers of bucket (``tokens``, ``rows``) with the
        padding of the module docstring."""
        n, r = input_ids.shape[0], meta.num_reqs
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:tokens].fill_(-1)
        self.query_start_loc[: r + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[r + 1 : rows + 1].fill_(tokens)
        self.seq_lens[:r].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[r:rows].zero_()
        self.block_tables[:r, :width].copy_(meta.block_tables, non_blocking=True)


class MixedGraphs:
    """Capture ``forward`` (``-> hidden [tokens, hidden]``) per token bucket, then ``run``
    steps of any mix of prefill chunks and decodes that fit one (module docstring)."""

    def __init__(
        self,
        forward: HiddenForward,
        *,
        buckets: list[int],
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        make_capture: Callable[[], Capture] | None = None,
    ) -> None:
        """``make_capture``: None for CUDA graphs (needs a CUDA device); tests pass
        ``EagerCapture``."""
        if make_capture is None:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
            make_capture = lambda: CudaCapture(device)  # noqa: E731
        if not buckets or min(buckets) < 1 or max_num_seqs < 1:
            raise ValueError(f"buckets must be positive token counts, got {buckets}")
        self.forward = forward
        self.buckets = sorted(set(buckets))
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.make_capture = make_capture
        self.buffers = MixedBuffers.allocate(
            self.buckets[-1],
            self.rows_for(self.buckets[-1]),
            max_blocks_per_req,
            hidden_size,
            dtype,
            device,
        )
        self._graphs: dict[int, Capture] = {}
        self.pool: Any = None  # the memory pool the captures used
        self.num_replays = 0  # steps served by a graph (tests and logs read it)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def rows_for(self, tokens: int) -> int:
        """Request rows of a bucket: as many requests as a step of ``tokens`` can hold
        (each has at least one token, at most ``max_num_seqs``), plus the padding one."""
        return min(tokens, self.max_num_seqs) + 1

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Capture every bucket, largest first, into one memory pool: nothing a graph
        allocates outlives its replay (the output goes to ``buffers.hidden``), so replays
        in any order are safe. ``pool``: another set's (``self.pool``) to share; the
        LoRA set shares the base set's (engine/executor/model_runner.py ``bind_lora``)."""
        for tokens in reversed(self.buckets):
            rows = self.rows_for(tokens)
            self.buffers.pad_only(tokens, rows)
            capture = self.make_capture()
            pool = capture.capture(self._step_fn(tokens, rows), pool)
            self._graphs[tokens] = capture
        self.pool = pool
        if self.buffers.hidden.is_cuda:
            torch.cuda.synchronize(self.buffers.hidden.device)
        logger.info(
            "captured mixed-step CUDA graphs for %d token counts, %d..%d",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
        )

    def _step_fn(self, tokens: int, rows: int) -> Callable[[], None]:
        b = self.buffers
        meta = b.meta(tokens, rows, self.max_model_len)
        ids, pos, out = b.input_ids[:tokens], b.positions[:tokens], b.hidden[:tokens]

        def step() -> None:
            out.copy_(self.forward(ids, pos, meta))

        return step

    def bucket_for(self, num_tokens: int, num_reqs: int) -> int | None:
        """Smallest captured bucket holding the step, or None (run eagerly)."""
        for tokens in self.buckets:
            if tokens >= num_tokens and tokens in self._graphs:
                return tokens if num_reqs < self.rows_for(tokens) else None
        return None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay for one step; returns its hidden states ``[num_tokens, hidden]`` (a view
        of ``buffers.hidden``: the next replay overwrites it)."""
        n = input_ids.shape[0]
        tokens = self.bucket_for(n, meta.num_reqs)
        if tokens is None:
            raise ValueError(
                f"no captured mixed graph holds {n} tokens of {meta.num_reqs} requests "
                f"(largest {self.max_tokens} tokens); run eagerly"
            )
        if meta.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            raise ValueError(
                f"block table width {meta.block_tables.shape[1]} exceeds the captured "
                f"{self.buffers.block_tables.shape[1]}"
            )
        if meta.max_seq_len > self.max_model_len:
            raise ValueError(
                f"max_seq_len {meta.max_seq_len} exceeds the captured {self.max_model_len}"
            )
        self.buffers.load(input_ids, positions, meta, tokens, self.rows_for(tokens))
        self._graphs[tokens].replay()
        self.num_replays += 1
        return self.buffers.hidden[:n]
