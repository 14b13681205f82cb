"""Building a model at its real size: on the meta device, then materialized one decoder
layer at a time (docs/design.md §3 "Loading at real size").

A model built on the device in float32 and cast afterwards peaks at twice its bf16 size
(Qwen3-30B-A3B: 122 GB for 61 GB of weights), and ``quantization="fp8"`` on a bf16
checkpoint peaked at the bf16 model before a byte was quantized. Here:

* the module tree is built on the meta device (no storage), and every parameter outside
  the decoder layers (embedding, final norm, LM head) is allocated in the model dtype;
* checkpoint tensors are read in layer order (``iter_safetensors`` sorts the keys of
  every shard by layer), so each layer is allocated when its first tensor arrives and
  finished when the next layer's arrives: complete (every parameter set), and, for FP8
  quantized at load, quantized right then (from float32, as before) and its float32
  copies freed;
* dummy weights take the same path (each layer drawn, then quantized).

The peak is the served model plus one layer in its loading precision (the model dtype,
or float32 while a layer waits to be quantized) plus one checkpoint tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack

import torch
from torch import nn

from engine.models.fp8 import cast_unquantized, quantize_layer
from engine.models.layer_ops import LayerOps
from engine.models.rope import RotaryEmbedding
from engine.models.weights import CheckpointCopier, checkpoint_entries

# The model is ``engine.models.llama.LlamaForCausalLM`` (not imported: it imports weights).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` (which honours a module's own ``_apply``: DeepSeek's float32
    router), or ``cast_unquantized`` where FP8 weights must stay as they are."""
    if any(p.dtype == torch.float8_e4m3fn for p in module.parameters()):
        cast_unquantized(module, dtype)
    else:
        module.to(dtype)


def layer_of(name: str) -> int | None:
    """The decoder layer a (checkpoint or module) tensor name belongs to, else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, the non-layer ones first, then layer by layer
    (shards are memory-mapped; a tensor is read when it is yielded)."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights found in {model_dir!r}")
    with ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(os.path.join(model_dir, n), framework="pt"))
            for n in files
        ]
        keys = [(k, h) for h in handles for k in h.keys()]  # noqa: SIM118 - no __iter__

        def order(entry: tuple[str, object]) -> tuple[int, str]:
            layer = layer_of(entry[0])
            return (-1 if layer is None else layer, entry[0])

        for key, handle in sorted(keys, key=order):
            yield key, handle.get_tensor(key)  # type: ignore[attr-defined]


def materialize(
    module: nn.Module, device: torch.device | str, memo: dict[int, nn.Parameter]
) -> None:
    """Give every meta parameter of ``module`` (rotary tables excepted: ``RotaryEmbedding.
    rebuild``) uninitialised storage on ``device`` in its own dtype. ``memo`` keeps tied
    parameters tied (the LM head that is the embedding's tensor)."""
    for sub in module.modules():
        if isinstance(sub, RotaryEmbedding):
            continue
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            real = memo.get(id(param))
            if real is None:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                real = memo[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            sub._parameters[name] = real


class LayerwiseLoader:
    """Fills a meta-built model (``LlamaForCausalLM``) one decoder layer at a time; see
    the module docstring. ``quantize_ops``: quantize each layer to FP8 as it is finished
    (its layers then load in float32 and are cast to ``dtype`` after quantizing)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        dtype: torch.dtype,
        quantize_ops: LayerOps | None = None,
        per_tensor: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.quantize_ops = quantize_ops
        self.per_tensor = per_tensor  # quantize with per-tensor scales (engine/models/fp8.py)
        self.layers: nn.ModuleList = model.layers  # type: ignore[assignment]
        self.finished: set[int] = set()
        # Everything but the layers, in the model dtype, allocated now (one memo: the
        # tied head and embedding stay one tensor).
        memo: dict[int, nn.Parameter] = {}
        for name, child in model.named_children():
            if name != "layers":
                _cast(child, dtype)
                materialize(child, device, memo)
        for layer in self.layers:
            # Quantized at load: float32 until quantized, as the whole model was before.
            _cast(layer, torch.float32 if quantize_ops is not None else dtype)

    def _start(self, index: int) -> None:
        if index in self.finished:
            raise ValueError(
                f"checkpoint tensors of layer {index} are not contiguous in the load order"
            )
        materialize(self.layers[index], self.device, {})

    def _finish(self, index: int, check: Callable[[int, nn.Module], None]) -> None:
        layer = self.layers[index]
        check(index, layer)
        if self.quantize_ops is not None:
            quantize_layer(layer, self.quantize_ops, self.per_tensor)
            cast_unquantized(layer, self.dtype)
        self.finished.add(index)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint in (``ValueError`` for an unexpected tensor or a parameter
        left unset); every layer must have tensors."""
        copier = CheckpointCopier(self.model)
        copier.refresh((n, p) for n, p in self.model.named_parameters() if layer_of(n) is None)
        copier.zero_vocab_padding()

        def check(index: int, layer: nn.Module) -> None:
            copier.check(f"layers.{index}.{n}" for n, _ in layer.named_parameters())
            copier.drop(f"layers.{index}.")

        current: int | None = None
        for hf_name, name, tensor in checkpoint_entries(self.model, weights):
            index = layer_of(name)
            if index is not None and index != current:
                if current is not None:
                    self._finish(current, check)
                self._start(index)
                current = index
                copier.refresh(self.layers[index].named_parameters(), f"layers.{index}.")
            copier.copy(hf_name, name, tensor)
        if current is not None:
            self._finish(current, check)
        copier.check(n for n, _ in self.model.named_parameters() if layer_of(n) is None)
        unloaded = [i for i in range(len(self.layers)) if i not in self.finished]
        if unloaded:
            raise ValueError(f"checkpoint is missing every weight of layers {unloaded[:5]}")
        self._done()

    def load_whole(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        load_fn: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    ) -> None:
        """For a model with its own loader (``load_fn``, DeepSeek's): every layer is
        allocated first, then loaded, then quantized layer by layer when asked (the
        peak is the served model in the loading precision)."""
        for attr in ("embed_tokens", "lm_head"):
            vocab = getattr(self.model, attr, None)
            if vocab is not None:
                vocab.weight.data.zero_()  # the vocab slice's padding rows stay zero
        for index in range(len(self.layers)):
            self._start(index)
        load_fn(weights)
        for index in range(len(self.layers)):
            self._finish(index, lambda _i, _layer: None)
        self._done()

    def dummy(self, seed: int) -> None:
        """Small random weights (shape is what sets speed in benchmarks), norms at one,
        drawn layer by layer."""
        gens: dict[torch.device, torch.Generator] = {}

        def fill(named: Iterable[tuple[str, nn.Parameter]]) -> None:
            with torch.no_grad():
                for name, param in named:
                    if "norm" in name:
                        param.fill_(1.0)
                        continue
                    gen = gens.get(param.device)
                    if gen is None:
                        gen = torch.Generator(device=param.device).manual_seed(seed)
                        gens[param.device] = gen
                    param.normal_(0.0, 0.02, generator=gen)

        fill((n, p) for n, p in self.model.named_parameters() if layer_of(n) is None)
        for index, layer in enumerate(self.layers):
            self._start(index)
            fill(layer.named_parameters())
            self._finish(index, lambda _i, _layer: None)
        self._done()

    def _done(self) -> None:
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.rebuild(self.device)
