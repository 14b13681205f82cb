"""The engine's Triton LoRA path (the work list, the per-layer shrink outputs, the
kernels: engine/lora/) on the CPU through Triton's interpreter: a tiny Llama serving
three adapters and the base model in mixed batches (prefill chunks of several 16-token
blocks per adapter, then decodes) gives the same greedy tokens as the torch path.
tests/gpu/test_lora_gpu.py runs the same comparison on CUDA, through the CUDA graphs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tests.triton_interpreter import run_interpreted


def compare_paths(root: Path) -> dict[str, object]:
    from engine import LLM, LoRARequest, SamplingParams
    from tests.lora_fixtures import make_adapter
    from tests.model_fixtures import make_tiny_llama

    base = make_tiny_llama(root / "base")
    adapters = [make_adapter(base, root / f"a{i}", seed=i, r=8 >> i) for i in range(3)]
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8, max_num_batched_tokens=96, kv_cache_memory=1 << 26)  # fmt: skip
    prompts = [[1, *range(300 + 17 * i, 340 + 17 * i)] for i in range(6)]
    loras = [
        None if i % 4 == 3 else LoRARequest(f"a{i % 4}", 1, str(adapters[i % 4])) for i in range(6)
    ]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    slots = llm.engine.lora.slots
    slots.use_triton = True  # the CUDA path, kernels interpreted
    triton_out = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
    slots.use_triton = False
    llm.engine.reset_prefix_cache()
    torch_out = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=[None] * 6)]
    base_out = torch_out
    llm.engine.reset_prefix_cache()
    torch_out = [o.token_ids for o in llm.generate(prompts, greedy, lora_request=loras)]
    llm.shutdown()
    return {"triton": triton_out, "torch": torch_out, "base": base_out}


def test_triton_path_equals_torch_path_in_the_engine() -> None:
    out, _ = run_interpreted(__file__, timeout_s=600)
    assert out["triton"] == out["torch"]
    # The adapters change the tokens (the comparison is not of two base-model runs).
    assert out["torch"] != out["base"]
    assert out["torch"][3] == out["base"][3]  # prompt 3 runs on the base model


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(compare_paths(Path(tmp))))
