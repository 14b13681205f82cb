"""Synthetic steps over a paged cache, for the mixed-graph tests and benchmark.

``SyntheticRequests`` holds requests with random token ids and shuffled, disjoint blocks
(block 0 is never handed out: a padded block-table entry points there), and builds the
flattened inputs of a step the way the model runner does: each scheduled request's next
``q_len`` tokens after the ones already computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata


@dataclass(slots=True)
class SyntheticStep:
    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_reqs] int64: each request's last row


class SyntheticRequests:
    """``num_reqs`` requests of up to ``max_len`` tokens each over ``block_size`` blocks."""

    def __init__(
        self,
        num_reqs: int,
        max_len: int,
        block_size: int,
        vocab_size: int,
        seed: int,
        device: torch.device | str,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        per = -(-max_len // block_size)
        perm = torch.randperm(num_reqs * per, generator=gen) + 1
        self.blocks = [perm[i * per : (i + 1) * per].tolist() for i in range(num_reqs)]
        self.tokens = torch.randint(0, vocab_size, (num_reqs, max_len), generator=gen)
        self.done = [0] * num_reqs
        self.block_size = block_size
        self.max_len = max_len
        self.device = torch.device(device)

    @property
    def num_blocks(self) -> int:
        """Blocks a cache needs for every request (block 0 included)."""
        return 1 + sum(len(b) for b in self.blocks)

    def step(self, chunks: list[tuple[int, int]]) -> SyntheticStep:
        """Inputs of one step scheduling ``q_len`` new tokens of each ``(request, q_len)``."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts, seq_lens = [0], []
        bs = self.block_size
        for r, q in chunks:
            lo, hi = self.done[r], self.done[r] + q
            if q < 1 or hi > self.max_len:
                raise ValueError(f"request {r}: {q} tokens from {lo} exceed {self.max_len}")
            ids += self.tokens[r, lo:hi].tolist()
            pos += list(range(lo, hi))
            slots += [self.blocks[r][p // bs] * bs + p % bs for p in range(lo, hi)]
            starts.append(starts[-1] + q)
            seq_lens.append(hi)
            self.done[r] = hi
        width = max(-(-s // bs) for s in seq_lens)
        table = torch.zeros((len(chunks), width), dtype=torch.int32)
        for i, ((r, _), s) in enumerate(zip(chunks, seq_lens, strict=True)):
            n = -(-s // bs)
            table[i, :n] = torch.tensor(self.blocks[r][:n], dtype=torch.int32)
        dev = self.device

        def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=dev)

        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(starts, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=table.to(dev),
            max_query_len=max(q for _, q in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return SyntheticStep(
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64),
            meta=meta,
            logits_indices=t([s - 1 for s in starts[1:]], torch.int64),
        )
