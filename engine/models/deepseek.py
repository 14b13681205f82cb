"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): the shared
decoder (engine/models/llama.py) with multi-head latent attention in every layer
(engine/models/mla.py), DeepSeek's MoE after the first ``first_k_dense_replace`` dense
layers (engine/models/deepseek_moe.py) and its own checkpoint names
(engine/models/deepseek_weights.py). The layer choice follows ``ModelArgs.mla`` and
``ModelArgs.routing``; what differs here is the loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.deepseek_weights import load_deepseek
from engine.models.llama import LlamaForCausalLM


class DeepseekForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_deepseek(self, weights)
