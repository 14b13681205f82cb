"""Pipeline-parallel stages: which contiguous layers a stage owns (docs/design.md §3
"Pipeline parallelism").

``pipeline_parallel_size`` P splits the decoder layers into P equal, contiguous runs:
stage s owns layers ``[s * L / P, (s + 1) * L / P)``. Stage 0 also holds the embedding,
the last stage the final norm and the LM head (with tied embeddings it loads the
embedding's tensor as its head). A stage's module and its KV cache hold only its own
layers, indexed from 0 (the stage's local layer ``i`` is global layer ``first + i``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^layers\.(\d+)\.")


def check_pipeline_parallel(num_layers: int, size: int) -> None:
    """``ValueError`` unless ``size`` stages can each own the same number of layers."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}")
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {size} exceeds the model's {num_layers} layers "
            "(num_hidden_layers): every stage needs at least one layer"
        )
    if num_layers % size:
        fits = [p for p in range(1, num_layers + 1) if num_layers % p == 0]
        raise ValueError(
            f"pipeline_parallel_size {size} does not divide the model's {num_layers} layers "
            f"(num_hidden_layers); sizes that do: {fits}"
        )


@dataclass(frozen=True, slots=True)
class Stage:
    """Stage ``index`` of ``size`` over a model of ``num_layers`` layers. The default
    (``Stage.whole(L)``) is the one stage that holds everything."""

    index: int
    size: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(0, 1, num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def layers(self) -> range:
        """The global indices of this stage's layers."""
        per = self.num_layers // self.size
        return range(self.index * per, (self.index + 1) * per)

    def local_name(self, name: str, tied: bool) -> str | None:
        """A checkpoint tensor's name in this stage's module (``layers.{global}`` becomes
        ``layers.{local}``), or None for a tensor another stage owns. ``tied``: the LM
        head is the embedding's tensor (the last stage loads it as ``lm_head.weight``)."""
        if self.size == 1:
            return name
        m = _LAYER.match(name)
        if m is not None:
            i = int(m.group(1))
            if i not in self.layers:
                return None
            return f"layers.{i - self.layers.start}.{name[m.end() :]}"
        if name == "embed_tokens.weight":
            if self.is_first:
                return name
            return "lm_head.weight" if self.is_last and tied else None
        if name.startswith(("norm.", "lm_head.")):
            return name if self.is_last else None
        return name
