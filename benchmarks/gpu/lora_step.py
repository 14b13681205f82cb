"""Decode step time with 8 LoRA adapters vs the base model alone, at batch 64.

A model directory with config + tokenizer only (``benchmarks/configs/llama-3.1-8b``) runs
with dummy weights; random PEFT-format adapters (rank ``--rank``, every attention and MLP
projection) are written next to it. Three runs of ``--batch`` requests with
``--prompt-len`` prompt tokens each decode ``--steps`` tokens, and the mean wall time of a
pure-decode ``LLMEngine.step()`` is reported:

* ``base``: an engine without LoRA (CUDA graphs as configured);
* ``base_lora_engine``: the LoRA engine, every request on the base model (graphs still);
* ``mixed``: the LoRA engine, request i on adapter i mod ``--adapters`` (on CUDA the
  Triton shrink/expand inside the decode graphs recorded with them, whose replays the
  report counts as ``mixed_graph_replays``; the torch path, eager, on the CPU).

Target (docs/lora.md): ``mixed / base <= 1.3`` at batch 64 with 8 adapters on the GPU.

    python -m benchmarks.gpu.lora_step --device cuda
    python -m benchmarks.gpu.lora_step --device cpu --model-config TINY --batch 8 --steps 8 --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import CONFIGS, recorded_command, result_path, write_report

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_dir(spec: str, work: Path) -> Path:
    """``TINY`` or a directory with a config.json (weights are dummy either way)."""
    out = work / "model"
    out.mkdir()
    if spec == "TINY":
        (out / "config.json").write_text(json.dumps(TINY))
    else:
        for f in Path(spec).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
    return out


def write_adapter(path: Path, cfg: dict[str, Any], rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from engine.lora.adapter import module_shapes
    from engine.models.config import ModelArgs

    args = ModelArgs.from_hf(cfg)
    shapes = module_shapes(args)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for m in TARGETS:
            fan_in, fan_out = shapes[m]
            group = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))


def decode_step_times(
    engine: Any, batch: int, prompt_len: int, steps: int, loras: list[str | None]
) -> list[float]:
    """Wall seconds of ``steps`` pure-decode ``engine.step()`` calls with all ``batch``
    requests running. The prompts' prefill is spread over several steps (the token
    budget), during which the first requests already decode: every request gets enough
    tokens to outlast that stagger, so the batch is whole when the measured steps come."""
    from engine.core.sampling_params import SamplingParams

    budget = engine.scheduler.config.max_num_batched_tokens
    stagger = min(batch, -(-batch * prompt_len // budget)) + 2
    params = SamplingParams(max_tokens=steps + stagger, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 3 for j in range(prompt_len)]
        engine.add_request(
            f"r{time.monotonic_ns()}-{i}", prompt, params, lora_name=loras[i % len(loras)]
        )
    times: list[float] = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        # Every prompt computed. (Not ``num_tokens - 1``: under async scheduling, the
        # default on CUDA, the token in flight already counts as computed.)
        decoding = (
            len(running) == batch
            and not len(engine.scheduler.waiting)
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        )
        t0 = time.perf_counter()
        engine.step()
        if decoding and len(times) < steps:
            times.append(time.perf_counter() - t0)
    if engine.config.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    if not times:
        raise RuntimeError(f"no pure-decode step with all {batch} requests running")
    return times


def decode_step_ms(
    engine: Any, batch: int, prompt_len: int, steps: int, loras: list[str | None]
) -> float:
    """Median ms of a pure-decode step at ``batch`` (the first two steps dropped)."""
    times = decode_step_times(engine, batch, prompt_len, steps, loras)
    return 1000 * statistics.median(times[2:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-config", default=str(CONFIGS / "llama-3.1-8b"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=str(result_path("gpu", "lora_step_h200.json")))
    a = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mdir = model_dir(a.model_config, work)
        cfg = json.loads((mdir / "config.json").read_text())
        mods = []
        for i in range(a.adapters):
            write_adapter(work / f"lora{i}", cfg, a.rank, i)
            mods.append((f"lora{i}", str(work / f"lora{i}")))
        common = dict(model=str(mdir), load_format="dummy", device=a.device,
                      max_num_seqs=max(a.batch, 8), max_model_len=a.prompt_len + a.steps + a.batch + 16)  # fmt: skip
        if a.device == "cpu":
            common["kv_cache_memory"] = 1 << 30
        results: dict[str, float] = {}
        base = LLMEngine(EngineConfig(**common))
        decode_step_ms(base, a.batch, a.prompt_len, 4, [None])  # warm-up (compiles, graphs)
        results["base"] = decode_step_ms(base, a.batch, a.prompt_len, a.steps, [None])
        base.shutdown()
        del base
        lora = LLMEngine(EngineConfig(**common, enable_lora=True, max_loras=a.adapters,
                                      max_lora_rank=a.rank, lora_modules=tuple(mods)))  # fmt: skip
        names: list[str | None] = [n for n, _ in mods]
        decode_step_ms(lora, a.batch, a.prompt_len, 4, names)  # warm-up (Triton compiles)
        results["base_lora_engine"] = decode_step_ms(lora, a.batch, a.prompt_len, a.steps, [None])
        graphs = lora.runner.lora_graphs
        replays_before = graphs.num_replays if graphs is not None else 0
        results["mixed"] = decode_step_ms(lora, a.batch, a.prompt_len, a.steps, names)
        replays = None if graphs is None else graphs.num_replays - replays_before
        lora.shutdown()
    report = {
        "device": a.device, "model_config": a.model_config, "batch": a.batch,
        "adapters": a.adapters, "rank": a.rank, "prompt_len": a.prompt_len,
        "step_ms": results, "mixed_over_base": results["mixed"] / results["base"],
        "mixed_graph_replays": replays,
        "command": recorded_command("benchmarks.gpu.lora_step"),
    }  # fmt: skip
    write_report(report, a.out, a.device)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
