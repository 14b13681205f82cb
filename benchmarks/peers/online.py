"""The online comparison: one server on one GPU, driven by ``pdserve bench serve``.

    python -m benchmarks.peers.online --server vllm --precision bf16 --json out.json
    python -m benchmarks.peers.online --server pdserve --mode colocated --precision fp8 ...

Each invocation starts one server, waits for it, sweeps the request rates with the same
load generator and the same prompts, writes one JSON and stops the server. Run the servers
one after the other on the same GPU (benchmarks/peers/README.md, "Online").

What both servers get (the model, the prompts, the load):
* the Llama-3.1-8B shape of ``benchmarks/configs/llama-3.1-8b`` with dummy (random)
  weights, except that the vocabulary is the tokenizer's (``--tokenizer``, SmolLM2's 49,152
  tokens, since no Llama tokenizer can be carried to the GPU machine): the same model on
  both sides, with an LM head 0.4x the 8B's;
* the seeded ShareGPT-like lengths of ``workloads.mixed_set`` (prompt median 160, output
  median 140 tokens) as text of exactly those token counts, streamed completions with
  ``ignore_eos`` so each request makes its tokens;
* a Poisson stream at each of ``--rates`` (requests/s), ``--num-prompts`` requests each,
  after two warm-up requests; goodput counts requests with TTFT <= 1 s and TPOT <= 50 ms
  (``--goodput``), and the ITL p99 of each rate is reported beside it.
Each server runs at its defaults apart from the model, ``--load-format dummy``,
``--max-model-len 4096`` and the precision (FP8: e4m3 weights quantized at load and an e4m3
KV cache on both).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.peers.workloads import mixed_set

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "benchmarks" / "configs" / "llama-3.1-8b" / "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_MODEL_LEN = 4096
SLO = ("ttft:1000", "tpot:50")


def build_model_dir(base_config: Path, tokenizer_dir: Path, out: Path) -> Path:
    """The config's shape with the tokenizer's vocabulary and special ids, plus the tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = json.loads(base_config.read_text())
    config["vocab_size"] = len(tok)
    config["bos_token_id"] = tok.bos_token_id if tok.bos_token_id is not None else 0
    config["eos_token_id"] = tok.eos_token_id if tok.eos_token_id is not None else 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def write_prompts(tokenizer_dir: Path, n: int, seed: int, path: Path) -> dict[str, float]:
    """The mixed set's lengths as JSONL text prompts; returns the mean lengths."""
    import random

    from pdserve.bench.workloads import load_codec, random_text

    codec = load_codec(str(tokenizer_dir))
    rng = random.Random(seed)
    requests = mixed_set(n, vocab=len(codec.sample_pool()), seed=seed)
    in_total = out_total = 0
    with path.open("w") as f:
        for req in requests:
            text, got = random_text(codec, len(req.prompt), rng)
            in_total += got
            out_total += req.max_tokens
            f.write(json.dumps({"prompt": text, "max_tokens": req.max_tokens}) + "\n")
    return {"mean_prompt_tokens": in_total / n, "mean_output_tokens": out_total / n}


def server_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    if args.server == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        cmd += ["--port", str(port), "--host", "127.0.0.1", "--load-format", "dummy"]
        cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "bench"]
        if args.precision == "fp8":
            cmd += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
        return cmd
    cmd = [sys.executable, "-m", "pdserve", "up", "--model", str(model), "--device", args.device]
    cmd += ["--port", str(port), "--load-format", "dummy", "--served-model-name", "bench"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--mode", args.mode]
    if args.mode == "colocated":
        cmd += ["--prefill", "0", "--decode", "1"]
    else:
        cmd += ["--prefill", "1", "--decode", "1", "--connector", args.connector]
    if args.precision == "fp8":
        cmd += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    return cmd + list(args.server_arg)


def wait_ready(base: str, proc: subprocess.Popen[bytes], deadline_s: float) -> float:
    """Seconds until a one-token completion answers 200 (a router can list its models
    before its engines are up); raises if the server dies or the deadline passes."""
    start = time.monotonic()
    body = json.dumps({"model": "bench", "prompt": "Hello", "max_tokens": 1}).encode()
    while time.monotonic() - start < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        req = urllib.request.Request(
            f"{base}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise TimeoutError(f"server not ready after {deadline_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def label(args: argparse.Namespace) -> str:
    name = "vllm" if args.server == "vllm" else f"pdserve-{args.mode}"
    variant = f"-{args.variant}" if args.variant else ""
    return f"{name}{variant}-{args.precision}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="peers-online-"))
    model = build_model_dir(Path(args.config), Path(args.tokenizer), work / "model")
    prompts = work / f"prompts-{args.num_prompts}-{args.seed}.jsonl"
    lengths = write_prompts(Path(args.tokenizer), args.num_prompts, args.seed, prompts)
    base = f"http://127.0.0.1:{args.port}"
    cmd = server_command(args, model, args.port)
    log_path = Path(args.log or work / f"{label(args)}.log")
    env = dict(os.environ, PYTHONPATH=args.server_pythonpath or os.environ.get("PYTHONPATH", ""))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        ready_s = wait_ready(base, proc, args.startup_timeout)
        print(f"{label(args)}: ready after {ready_s:.0f} s", flush=True)
        result_json = work / f"{label(args)}-bench.json"
        bench = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", f"{base}/v1"]
        bench += ["--model", "bench", "--tokenizer", str(args.tokenizer), "--no-progress"]
        bench += ["--dataset-name", "jsonl", "--dataset-path", str(prompts)]
        bench += [
            "--num-prompts",
            str(args.num_prompts),
            "--num-warmups",
            "2",
            "--seed",
            str(args.seed),
        ]
        bench += ["--sweep-rates", ",".join(f"{r:g}" for r in args.rates), "--goodput", *SLO]
        bench += ["--request-timeout", "600", "--result-json", str(result_json)]
        subprocess.run(bench, check=True, timeout=args.bench_timeout)
    finally:
        stop(proc)
    return {
        "label": label(args),
        "server_command": shlex.join(cmd),
        "ready_s": ready_s,
        "workload": {"num_prompts": args.num_prompts, "seed": args.seed, **lengths},
        "slo": list(SLO),
        "bench": json.loads(result_json.read_text()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--server", choices=("vllm", "pdserve"), required=True)
    p.add_argument("--mode", choices=("colocated", "auto", "disaggregated"), default="colocated")
    p.add_argument("--connector", default="p2p", help="pdserve --mode auto|disaggregated")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    p.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[6, 12, 24, 48]
    )
    p.add_argument("--num-prompts", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=str(BASE_CONFIG), help="config.json of the shape")
    p.add_argument("--device", default="cuda", help="pdserve only (cpu: a dry run, tiny shape)")
    p.add_argument("--tokenizer", default=str(REPO / ".carry" / "tokenizer"))
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--startup-timeout", type=float, default=480)
    p.add_argument("--bench-timeout", type=float, default=420)
    p.add_argument("--server-pythonpath", help="PYTHONPATH for the server process only")
    p.add_argument("--server-arg", action="append", default=[], help="extra pdserve up flag")
    p.add_argument("--variant", default="", help="a name for this run's settings, in its label")
    p.add_argument("--workdir")
    p.add_argument("--log")
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # runs run()'s finally: the server stops


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    doc = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
