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
"""

from __future__ import annotations

import numpy as np
import torch

from engine.lora.adapter import SUBMODULES, LoRAAdapter, module_shapes
from engine.models.config import ModelArgs


class LoRASlots:
    """Owner of the slot stacks and the step's token -> slot index (-1: base model)."""

    def __init__(
        self, args: ModelArgs, max_loras: int, max_rank: int, dtype: torch.dtype, device: str
    ) -> None:
        self.max_loras, self.rank = max_loras, max_rank
        self.device = torch.device(device)
        shapes = module_shapes(args)
        # kind -> (output offset of each sub-module, their output sizes, in_features)
        self.layout: dict[str, tuple[list[int], list[int], int]] = {}
        for kind, mods in SUBMODULES.items():
            sizes = [shapes[m][1] for m in mods]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.layout[kind] = (offsets, sizes, shapes[mods[0]][0])
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(args.num_layers):
            a_l, b_l = {}, {}
            for kind, (_offs, sizes, fan_in) in self.layout.items():
                n = len(sizes)
                a_l[kind] = torch.zeros(max_loras, n * max_rank, fan_in, dtype=dtype, device=device)
                b_l[kind] = torch.zeros(max_loras, sum(sizes), max_rank, dtype=dtype, device=device)
            self.a.append(a_l)
            self.b.append(b_l)
        self.token_slots = torch.full((0,), -1, dtype=torch.int32, device=device)
        self.present: list[int] = []  # slots with tokens in this step, ascending
        self.use_triton = self.device.type == "cuda"

    @property
    def active(self) -> bool:
        return bool(self.present)

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
        if self.present:
            self.token_slots = torch.from_numpy(token_slots).to(self.device, non_blocking=True)

    def delta(self, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the LoRA term of ``x`` [T, in] to the projection output ``out`` [T, out_total]
        in place, each token with its own slot's weights."""
        a, b = self.a[layer][kind], self.b[layer][kind]
        offsets, sizes, _ = self.layout[kind]
        if self.use_triton:
            from engine.lora.triton_lora import lora_shrink_expand

            lora_shrink_expand(x, out, a, b, self.token_slots, offsets, self.rank)
        else:
            lora_torch(x, out, a, b, self.token_slots, self.present, offsets, sizes, self.rank)


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
        if self.slots.present:
            self.slots.delta(self.layer, kind, x, out)
        return out


def attach(model: torch.nn.Module, slots: LoRASlots) -> None:
    """Give every decoder layer's attention and MLP its ``LayerLoRA`` (engine/models/llama.py)."""
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr,arg-type]
        view = LayerLoRA(slots, i)
        layer.self_attn.lora = view
        layer.mlp.lora = view
