"""A step's model inputs: the flattened batch ("super sequence") of the scheduled requests'
new tokens, with positions, slot mapping, attention metadata and the rows whose logits the
step needs, built with little Python work per request (``InputBuilder``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.core.scheduler import ScheduledRequest
from engine.sampling.prompt_logprobs import wants_prompt_rows


@dataclass(slots=True)
class HostInputs:
    """A step's inputs on the host, before the copy to the device; what rank 0 hands the
    other tensor-parallel ranks (``engine/executor/tp/step_wire.py``). ``ids`` is empty when the step's
    token ids come from the device (async scheduling)."""

    ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slots: np.ndarray  # int64 [num_tokens]
    logits_idx: np.ndarray  # int64 [rows whose logits the step needs]
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    seq_lens: np.ndarray  # int32 [num_reqs]
    block_tables: np.ndarray  # int32 [num_reqs, max_blocks]
    max_query_len: int
    starts: list[int]  # query_start_loc as a list (the metadata's host copy)
    seq_lens_list: list[int]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


def logits_rows(scheduled: list[ScheduledRequest], starts: list[int]) -> list[int]:
    """Rows whose logits a step needs: each request's last position, plus the positions of
    its drafts (and the one before them) when it carries drafts to verify, or every
    position of a prompt chunk whose prompt logprobs are wanted."""
    rows: list[int] = []
    for s, start, end in zip(scheduled, starts, starts[1:], strict=False):
        first = start if wants_prompt_rows(s.request) else end - 1 - len(s.spec_token_ids)
        rows.extend(range(first, end))
    return rows


def _align(n: int) -> int:
    """Segment offsets in the packed staging buffers: multiples of 32 elements, so every
    device view starts 128-byte aligned (Triton specialises kernels on pointer alignment)."""
    return -(-n // 32) * 32


class InputBuilder:
    """Builds a step's ``StepInputs`` with little Python work per request.

    * Block tables persist on the host across steps, one row per scheduled request; a row
      is rewritten only from the ids appended since the request's last step (the KV
      manager's table epoch says when the whole table changed), and the step's
      ``[num_reqs, max_blocks]`` table is one numpy gather.
    * Positions and slots are computed with numpy from per-request starts and lengths.
    * On CUDA all int64 inputs are packed into one pinned staging buffer and all int32 ones
      into another, so a step costs two asynchronous host-to-device copies. The buffers are
      reused; an event recorded after the copies is waited on before they are overwritten.
      On CPU the tensors wrap fresh numpy arrays (no copy, nothing shared across steps).
    """

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_blocks_per_req: int,
        staged: bool | None = None,
    ) -> None:
        """``staged`` (default: on CUDA) packs the inputs into the reused staging buffers;
        tests force it on CPU, where the "device" copy is a clone of the staging slice."""
        self.device = device
        self.block_size = block_size
        self._table = np.zeros((0, max(1, max_blocks_per_req)), dtype=np.int32)
        # request_id -> (row in _table, table epoch, number of ids already in the row)
        self._rows: dict[str, tuple[int, int, int]] = {}
        self._cuda = device.type == "cuda"
        self._staged = self._cuda if staged is None else staged
        self._stage64 = torch.empty(0, dtype=torch.long)
        self._stage32 = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None

    def _grow_table(self, rows: int, width: int) -> None:
        old = self._table
        if rows <= old.shape[0] and width <= old.shape[1]:
            return
        table = np.zeros((max(rows, old.shape[0]), max(width, old.shape[1])), dtype=np.int32)
        table[: old.shape[0], : old.shape[1]] = old
        self._table = table

    def _table_rows(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """Bring each request's host block-table row up to date; returns the row indices."""
        old = self._rows
        n = len(scheduled)
        self._grow_table(n, max(len(s.block_ids) for s in scheduled))
        table = self._table
        # Rows of requests absent from this step are free again (they rebuild if they
        # come back); at most n rows are in use, and the table has at least n.
        keep = {old[s.request.request_id][0] for s in scheduled if s.request.request_id in old}
        free = [r for r in range(table.shape[0] - 1, -1, -1) if r not in keep]
        rows: dict[str, tuple[int, int, int]] = {}
        idx = np.empty(n, dtype=np.intp)
        for i, s in enumerate(scheduled):
            rid = s.request.request_id
            ids = s.block_ids
            entry = old.get(rid)
            if entry is None or rid in rows:  # new here (or listed twice): a fresh row
                row, done = free.pop(), 0
            else:
                row, epoch, done = entry
                if s.table_epoch < 0 or epoch != s.table_epoch or done > len(ids):
                    done = 0  # a different table: copy all of it
            if done < len(ids):
                table[row, done : len(ids)] = ids[done:]
            rows[rid] = (row, s.table_epoch, len(ids))
            idx[i] = row
        self._rows = rows
        return idx

    def build(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> StepInputs:
        """``input_ids`` (on the device), when given, are the step's token ids instead of
        the requests' own: async scheduling feeds a decode step the previous step's sampled
        tokens before the host has them."""
        return self.to_device(self.host(scheduled, input_ids), input_ids)

    def host(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> HostInputs:
        """The host half of ``build`` (``ids`` left empty when ``input_ids`` is given)."""
        if not scheduled:
            raise ValueError("scheduled must hold at least one request")
        bs = self.block_size
        n = len(scheduled)
        ids: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        comp: list[int] = []
        total = 0
        any_spec = False
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            num_tokens = req.num_tokens
            if input_ids is None:
                ids += req.token_ids_slice(start, min(end, num_tokens))
                if end > num_tokens:  # the tail comes from this step's drafts
                    ids += s.spec_token_ids[max(start, num_tokens) - num_tokens : end - num_tokens]
            any_spec = any_spec or bool(s.spec_token_ids) or wants_prompt_rows(req)
            total += s.num_new_tokens
            starts.append(total)
            seq_lens.append(end)
            comp.append(start)
        found = len(ids) if input_ids is None else input_ids.shape[0]
        if found != total:
            raise ValueError(f"scheduled {total} new tokens but found {found} token ids")
        qsl = np.array(starts, dtype=np.int64)
        lens = np.array(seq_lens, dtype=np.int64)
        have = np.fromiter((len(s.block_ids) for s in scheduled), dtype=np.int64, count=n)
        if (short := np.flatnonzero(have * bs < lens)).size:
            # A reused host row holds its previous occupant's ids past ``have``: without
            # this check those would become this request's slots (KV written into another
            # request's blocks).
            s = scheduled[int(short[0])]
            raise ValueError(
                f"block_ids of request {s.request.request_id!r} cover {len(s.block_ids) * bs} "
                f"tokens, fewer than the {seq_lens[int(short[0])]} it attends to this step"
            )
        rows = self._table_rows(scheduled)
        q = qsl[1:] - qsl[:-1]
        max_query_len = int(q.max())
        if max_query_len == 1:  # pure decode: one token per request
            positions = np.array(comp, dtype=np.int64)
            req_of_token = np.arange(n)
        else:
            req_of_token = np.repeat(np.arange(n), q)
            positions = np.arange(total, dtype=np.int64) + np.repeat(
                np.array(comp, dtype=np.int64) - qsl[:-1], q
            )
        nblocks = -(-lens // bs)
        max_blocks = max(1, int(nblocks.max()))
        tables = self._table[rows, :max_blocks]  # a gather: a new array
        # Zero what lies past each request's context (as a fresh zero-padded table would):
        # ids of blocks allocated ahead, or a previous occupant's ids in a reused row.
        tables[np.arange(max_blocks) >= nblocks[:, None]] = 0
        slots = tables[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        if any_spec:  # or prompt logprobs: more than the last row of some request
            logits_idx = np.array(logits_rows(scheduled, starts), dtype=np.int64)
        else:
            logits_idx = qsl[1:] - 1
        return HostInputs(
            np.array(ids, dtype=np.int64),
            positions,
            slots,
            logits_idx,
            qsl.astype(np.int32),
            lens.astype(np.int32),
            tables,
            max_query_len,
            starts,
            seq_lens,
        )

    def to_device(self, host: HostInputs, input_ids: torch.Tensor | None = None) -> StepInputs:
        """The device half of ``build``: copy ``host`` to the device (``input_ids``, on the
        device, replace ``host.ids``)."""
        n, max_blocks = host.block_tables.shape
        parts64 = (host.ids, host.positions, host.slots, host.logits_idx)
        parts32 = (host.query_start_loc, host.seq_lens, host.block_tables.reshape(-1))
        d64, d32 = self._to_device(parts64, parts32)
        meta = AttentionMetadata(
            slot_mapping=d64[2],
            query_start_loc=d32[0],
            seq_lens=d32[1],
            block_tables=d32[2].view(n, max_blocks),
            max_query_len=host.max_query_len,
            max_seq_len=max(host.seq_lens_list),
            query_start_loc_cpu=host.starts,
            seq_lens_cpu=host.seq_lens_list,
        )
        return StepInputs(
            input_ids=d64[0] if input_ids is None else input_ids,
            positions=d64[1],
            meta=meta,
            logits_indices=d64[3],
        )

    def _to_device(
        self, parts64: tuple[np.ndarray, ...], parts32: tuple[np.ndarray, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self._staged:
            return [torch.from_numpy(p) for p in parts64], [torch.from_numpy(p) for p in parts32]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the buffers
        out = []
        for attr, parts, dtype in (
            ("_stage64", parts64, torch.long),
            ("_stage32", parts32, torch.int32),
        ):
            offsets = [0]
            for p in parts:
                offsets.append(offsets[-1] + _align(p.size))
            stage = getattr(self, attr)
            if stage.numel() < offsets[-1]:
                stage = torch.empty(2 * offsets[-1], dtype=dtype, pin_memory=self._cuda)
                setattr(self, attr, stage)
            host = stage.numpy()
            for p, a in zip(parts, offsets, strict=False):
                host[a : a + p.size] = p
            if self._cuda:
                dev = stage[: offsets[-1]].to(self.device, non_blocking=True)
            else:
                dev = stage[: offsets[-1]].clone()
            out.append([dev[a : a + p.size] for p, a in zip(parts, offsets, strict=False)])
        if self._cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return out[0], out[1]
