"""Speculative decoding on CPU: tokens/s and acceptance rate, with and without, side by side.

    python -m benchmarks.engine.speculative   # writes benchmarks/results/engine/speculative.json

SmolLM2-135M-Instruct (float32, ``--threads`` torch threads), greedy, ``--max-tokens`` new
tokens per prompt, prompts run one at a time (batch 1: the latency setting speculation is
for; ``--batch`` submits each workload's prompts together instead). Two workloads:
- ``repetitive``: chat prompts whose answers copy from the prompt (rewrite code with a
  small change, quote sentences from a passage, edit a JSON document);
- ``open``: open-ended questions whose answers share little with the prompt.
Configurations: no speculation; ``ngram:k=4`` (prompt lookup);
``draft:k=3`` with a draft made from SmolLM2's own first ``--draft-layers`` layers (the only
smaller model sharing its tokenizer available offline; a layer-skip self-draft).
Every speculative run's outputs are compared with the baseline's (greedy: must be equal).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from common.models import resolve_model
from engine.config import EngineConfig
from engine.core.detokenizer import load_tokenizer
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""
PASSAGE = (
    'The committee met on Tuesday. "We will not raise the fees this year," the chair said. '
    'A member asked about the library. "The library will stay open until nine," she replied. '
    'Another member asked about parking. "Parking stays free for residents," the chair said.'
)
DOC = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first program", "city": "London"}'
WORKLOADS = {
    "repetitive": [
        f"Rewrite this Python code, renaming the variable total to acc. Output only code.\n\n{CODE}",
        f"Read the passage and list every quoted sentence, word for word.\n\n{PASSAGE}",
        f"Copy this JSON document exactly, changing only the city to Paris.\n\n{DOC}",
        f"Add a docstring to each function in this code and output the whole code.\n\n{CODE}",
    ],
    "open": [
        "Write a short poem about the sea.",
        "Why do leaves change colour in autumn?",
        "Give three tips for learning a new language.",
        "Describe your ideal weekend.",
    ],
}


def make_layer_draft(model_dir: str, layers: int, out_dir: Path) -> Path:
    """A draft model from the first ``layers`` decoder layers of ``model_dir`` (embeddings,
    final norm and tied head shared): same tokenizer, a fraction of the compute."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out_dir / "config.json").write_text(json.dumps(config))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if ".layers." in key and int(key.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            tensors[key] = f.get_tensor(key)
    save_file(tensors, str(out_dir / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copyfile(src / name, out_dir / name)
    return out_dir


def build_engine(model: str, speculative: str | None) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, speculative=speculative, num_kv_blocks=256))
    engine.add_request("warmup", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return engine


def run_pass(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, batch: bool, tag: str
) -> dict[str, Any]:
    """One pass over the workload; speculation counters are those of this pass only."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if engine.spec is not None:
        engine.spec.stats = type(engine.spec.stats)(engine.spec.stats.method, engine.spec.stats.k)
    outputs: dict[str, list[int]] = {}
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    groups = [list(enumerate(prompts))] if batch else [[(i, p)] for i, p in enumerate(prompts)]
    for group in groups:
        for i, prompt in group:
            engine.add_request(f"{tag}-{i}", prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats().spec
    return {
        "seconds": time.perf_counter() - t0,
        "output_tokens": sum(len(v) for v in outputs.values()),
        "engine_steps": engine.num_steps - steps0,
        "acceptance_rate": stats.acceptance_rate if stats else None,
        "draft_tokens": stats.num_draft_tokens if stats else 0,
        "accepted_tokens": stats.num_accepted_tokens if stats else 0,
        "mean_tokens_per_round": stats.mean_tokens_per_round if stats else None,
        "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))],
    }


def run_workload(
    engines: dict[str, LLMEngine], prompts: list[list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Interleave the configurations round by round (the machine is shared: a load spike
    then hits every configuration alike) and keep each one's median pass time."""
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        for name, engine in engines.items():
            passes[name].append(run_pass(engine, prompts, args.max_tokens, args.batch, f"{rnd}"))
    runs = []
    for name, ps in passes.items():
        seconds = sorted(p["seconds"] for p in ps)
        run = dict(ps[0]) | {
            "speculative": name,
            "seconds": seconds[len(seconds) // 2],
            "all_seconds": seconds,
        }
        run["tokens_per_s"] = run["output_tokens"] / run["seconds"]
        runs.append(run)
    for r in runs:
        r["identical_to_baseline"] = r["outputs"] == runs[0]["outputs"]
        r["speedup"] = r["tokens_per_s"] / runs[0]["tokens_per_s"]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved passes per configuration (median kept)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--batch", action="store_true", help="submit each workload's prompts together")
    ap.add_argument("--output-md", default=None, help="also write the markdown report here")
    ap.add_argument("--output-json", default=str(result_path("engine", "speculative.json")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    tok = load_tokenizer(model)
    with tempfile.TemporaryDirectory() as tmp:
        draft = make_layer_draft(model, args.draft_layers, Path(tmp) / "draft")
        engines = {
            "off": build_engine(model, None),
            "ngram:k=4": build_engine(model, "ngram:k=4"),
            f"draft:model=<SmolLM2 first {args.draft_layers} layers>,k=3": build_engine(
                model, f"draft:model={draft},k=3"
            ),
        }
        results: dict[str, list[dict[str, Any]]] = {}
        for workload, texts in WORKLOADS.items():
            chats = [
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            results[workload] = run_workload(engines, [list(tok.encode(c)) for c in chats], args)
            report(args, results)  # after each workload, so a cut-short run still reports


NOTES = """
Notes:
- `steps` counts target-model forward passes and, like acceptance, does not depend on the
  machine's load; tok/s and speedup are wall-clock ratios from a shared 2-core machine (other
  jobs ran beside this one), so read them as rough. Greedy outputs with speculation are
  token-identical to the baseline in every run (`identical`).
- The n-gram proposer pays off where the answer copies the prompt (repetitive: ~3.5 tokens per
  target pass) and costs little where it does not (open: it rarely finds a match, so most
  steps carry no drafts).
- The draft is SmolLM2's first layers with its final norm and head: the only smaller model
  sharing its tokenizer available offline. It almost never agrees with the full model, so it
  only costs here; a trained small draft (e.g. Llama-3.2-1B for Llama-3.1-8B) is the
  intended use of `draft:model=PATH`.
"""


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    command = recorded_command("benchmarks.engine.speculative")
    lines = [
        "# Speculative decoding on CPU",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"SmolLM2-135M fp32, greedy, {args.max_tokens} new tokens per prompt, "
        f"{'prompts batched' if args.batch else 'batch 1 (prompts one after another)'}; "
        f"upper median (of 2: the slower) of {args.rounds} interleaved passes per configuration.",
        "",
        "| workload | speculative | tok/s | speedup | acceptance | tokens/round | steps | identical |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for workload, runs in results.items():
        for r in runs:
            acc = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "–"
            tpr = f"{r['mean_tokens_per_round']:.2f}" if r["mean_tokens_per_round"] else "–"
            lines.append(
                f"| {workload} | {r['speculative'] or 'off'} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× "
                f"| {acc} | {tpr} | {r['engine_steps']} | {'yes' if r['identical_to_baseline'] else 'NO'} |"
            )
    text = "\n".join(lines) + "\n" + NOTES
    print(text)
    if args.output_md:
        Path(args.output_md).write_text(text)
    slim = {
        w: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
        for w, runs in results.items()
    }
    Path(args.output_json).write_text(
        json.dumps({"command": command, "results": slim}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
