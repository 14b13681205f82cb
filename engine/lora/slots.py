"""The device side of multi-LoRA: per layer and merged projection, stacks of every GPU
slot's A and B, and the step's per-token slot index (docs/lora.md).

Layout, for a merged projection of ``n`` sub-modules (q|k|v: 3, gate|up: 2, o/down: 1)
and ``R = max_lora_rank``:

* ``a[slot]``: ``[n * R, in]``, sub-module ``s``'s A in rows ``s*R .. s*R + r``;
* ``b[slot]``: ``[out, R]``, sub-module ``s``'s B (scaled) in its own output rows.

So one "shrink" (``x @ a[slot].T``) serves all sub-modules, and the "expand" takes, for
each output column, the R shrink columns of the sub-module that column belongs to. Rows
past an adapter's rank, and modules it does not target, stay zero. The model adds
``delta`` to a projection's output only while the step has LoRA tokens (``active``).

On CUDA the step's work list (engine/lora/plan.py) lives in one static device buffer
sized for ``max_tokens``, rewritten by ``set_batch`` each step: CUDA graphs captured
with the LoRA kernels (``capturing``) read it at every replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from engine.lora.adapter import SUBMODULES, LoRAAdapter, module_shapes
from engine.lora.plan import max_blocks, plan_blocks
from engine.models.config import ModelArgs


class LoRASlots:
    """Owner of the slot stacks and the step's token -> slot index (-1: base model)."""

    def __init__(
        self,
        args: ModelArgs,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
        max_tokens: int = 8192,
    ) -> None:
        """``max_tokens``: the most tokens a step has (its token budget); a larger step
        runs eagerly on a buffer of its own."""
        self.max_loras, self.rank = max_loras, max_rank
        self.device = torch.device(device)
        shapes = module_shapes(args)
        # kind -> (output offset of each sub-module, their output sizes, in_features)
        self.layout: dict[str, tuple[list[int], list[int], int]] = {}
        for kind, mods in SUBMODULES.items():
            sizes = [shapes[m][1] for m in mods]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.layout[kind] = (offsets, sizes, shapes[mods[0]][0])
        self.a, self.b = self._stacks(args.num_layers, dtype)
        self.token_slots = torch.full((0,), -1, dtype=torch.int32, device=device)
        self.present: list[int] = []  # slots with tokens in this step, ascending
        self.use_triton = self.device.type == "cuda"
        self.capturing = False  # a CUDA graph with the LoRA kernels is being recorded
        # Per layer, every kind's shrink output side by side: one zeroing per layer.
        widths = {kind: len(offs) * max_rank for kind, (offs, _, _) in self.layout.items()}
        self.y_cols = {k: sum(list(widths.values())[:i]) for i, k in enumerate(widths)}
        self.y_width = sum(widths.values())
        self._y: torch.Tensor | None = None  # this layer's zeroed shrink outputs
        self._programs: int | None = None  # the shrink grid to aim for (triton_lora.py)
        self.max_tokens = max_tokens
        self._rows = max_blocks(max_tokens, max_loras)
        self._work = torch.zeros(3 * self._rows + max_tokens, dtype=torch.int32, device=device)
        self.table, self.order = self._views(self._work, self._rows)
        # The host side of each step's copy (pinned on CUDA: asynchronous), reused once
        # the previous step's copy has read it (``_copied``).
        cuda = self.device.type == "cuda"
        self._stage = torch.zeros(self._work.numel(), dtype=torch.int32, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None

    def _stacks(
        self, layers: int, dtype: torch.dtype
    ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
        """Per layer and kind, the zeroed A ``[S, subs * R, in]`` and B ``[S, out, R]``."""
        a: list[dict[str, torch.Tensor]] = []
        b: list[dict[str, torch.Tensor]] = []
        s, r, dev = self.max_loras, self.rank, self.device
        for _ in range(layers):
            a.append({k: torch.zeros(s, len(sz) * r, fan_in, dtype=dtype, device=dev)
                      for k, (_, sz, fan_in) in self.layout.items()})  # fmt: skip
            b.append({k: torch.zeros(s, sum(sz), r, dtype=dtype, device=dev)
                      for k, (_, sz, _) in self.layout.items()})  # fmt: skip
        return a, b

    @property
    def active(self) -> bool:
        """Whether the model adds LoRA terms in this step (or records them in a graph)."""
        return bool(self.present) or self.capturing

    @property
    def graphable(self) -> bool:
        """Whether steps with adapter tokens may replay CUDA graphs (the Triton path reads
        only device data; the torch path reads ``present`` on the host)."""
        return self.use_triton

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the LoRA kernels into the CUDA graphs captured inside, with an empty
        work list (every program exits), so those graphs serve steps with adapters."""
        self.table, self.order = self._views(self._work, self._rows)
        self._work.zero_()
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
            self._y = None  # the last recorded layer's, from a graph's pool

    @staticmethod
    def _views(work: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return work[: 3 * rows].view(rows, 3), work[3 * rows :]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (zeroing what it does not target)."""
        sub_index = {m: (kind, i) for kind, mods in SUBMODULES.items() for i, m in enumerate(mods)}
        r, big_r = adapter.rank, self.rank
        for layer in range(len(self.a)):
            for kind in self.layout:
                self.a[layer][kind][slot].zero_()
                self.b[layer][kind][slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            kind, s = sub_index[module]
            off, size = self.layout[kind][0][s], self.layout[kind][1][s]
            self.a[layer][kind][slot, s * big_r : s * big_r + r].copy_(a)
            self.b[layer][kind][slot, off : off + size, :r].copy_(b)

    def set_batch(self, token_slots: np.ndarray) -> None:
        """The step's slot per token (int32, -1 for base-model tokens)."""
        present = np.unique(token_slots)
        self.present = [int(s) for s in present if s >= 0]
        if not self.present:
            return
        if not self.use_triton:
            self.token_slots = torch.from_numpy(token_slots).to(self.device, non_blocking=True)
            return
        n = len(token_slots)
        if n > self.max_tokens:  # beyond every graph: a buffer for this (eager) step
            rows = max_blocks(n, self.max_loras)
            table, order = plan_blocks(token_slots, rows)
            work = torch.from_numpy(np.concatenate([table.ravel(), order])).to(self.device)
            self.table, self.order = self._views(work, rows)
            return
        table, order = plan_blocks(token_slots, self._rows)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the stage
        host = self._stage.numpy()
        host[: table.size] = table.ravel()
        size = table.size + len(order)
        host[table.size : size] = order
        self._work[:size].copy_(self._stage[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.table, self.order = self._views(self._work, self._rows)

    def delta(self, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the LoRA term of ``x`` [T, in] to the projection output ``out`` [T, out_total]
        in place, each token with its own slot's weights."""
        a, b = self.a[layer][kind], self.b[layer][kind]
        offsets, sizes, _ = self.layout[kind]
        if self.use_triton:
            from engine.lora.triton_lora import lora_shrink_expand, target_programs

            if self._programs is None:  # once: it asks the device for its SM count
                self._programs = target_programs(x.device)
            lora_shrink_expand(
                x, out, a, b, self._shrink_out(kind, x.shape[0], x.device), self.table,
                self.order, offsets, sizes, self.rank, self._programs,
            )  # fmt: skip
        else:
            lora_torch(x, out, a, b, self.token_slots, self.present, offsets, sizes, self.rank)

    def _shrink_out(self, kind: str, tokens: int, device: torch.device) -> torch.Tensor:
        """``kind``'s zeroed float32 columns ``[tokens, subs * R]`` of the layer's shrink
        outputs; the layer's first projection (q|k|v) zeroes them all in one launch."""
        y = self._y
        if kind == "qkv" or y is None or y.shape[0] != tokens:
            y = self._y = torch.zeros(tokens, self.y_width, dtype=torch.float32, device=device)
        col = self.y_cols[kind]
        return y[:, col : col + len(self.layout[kind][0]) * self.rank]


def lora_torch(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    present: list[int],
    offsets: list[int],
    sizes: list[int],
    rank: int,
) -> None:
    """The reference: for each slot in the step, its tokens' rows gathered, shrunk by the
    slot's A, expanded by each sub-module's B, added back at those rows."""
    for slot in present:
        rows = (token_slots == slot).nonzero().squeeze(1)
        xs = x.index_select(0, rows)
        shrunk = xs @ a[slot].T  # [n, subs * R]
        for s, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            part = shrunk[:, s * rank : (s + 1) * rank] @ b[slot, off : off + size].T
            out[:, off : off + size].index_add_(0, rows, part.to(out.dtype))


class LayerLoRA:
    """One decoder layer's view of the slots: what its attention and MLP modules call."""

    __slots__ = ("layer", "slots")

    def __init__(self, slots: LoRASlots, layer: int) -> None:
        self.slots, self.layer = slots, layer

    def add(self, kind: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the step's LoRA terms added (in place); unchanged when no token of
        the step uses an adapter."""
        if self.slots.active:
            self.slots.delta(self.layer, kind, x, out)
        return out


def attach(model: torch.nn.Module, slots: LoRASlots) -> None:
    """Give every decoder layer's attention and MLP its ``LayerLoRA`` (engine/models/llama.py)."""
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr,arg-type]
        view = LayerLoRA(slots, i)
        layer.self_attn.lora = view
        layer.mlp.lora = view
