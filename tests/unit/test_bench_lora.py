"""`pdserve bench serve --lora-models`: a mixed-adapter workload spreads the prompts over
the base model and the adapters, each prompt always to the same one."""

from __future__ import annotations

import argparse
from collections import Counter

from pdserve.bench.serve import add_serve_parser, config_from_args
from pdserve.bench.serve_client import Target, build_body
from pdserve.bench.workloads import Prompt


def test_prompts_spread_over_base_and_adapters() -> None:
    target = Target("http://h", "base", lora_models=("a", "b", "c"))
    prompts = [Prompt(f"prompt number {i}", 3, 4) for i in range(400)]
    models = [build_body(target, p)["model"] for p in prompts]
    counts = Counter(models)
    assert set(counts) == {"base", "a", "b", "c"}
    assert min(counts.values()) > 60  # about 100 each
    assert models == [build_body(target, p)["model"] for p in prompts]  # stable
    assert build_body(Target("http://h", "base"), prompts[0])["model"] == "base"


def test_flag_reaches_the_target() -> None:
    root = argparse.ArgumentParser()
    add_serve_parser(root.add_subparsers())
    argv = ["serve", "--model", "base", "--lora-models", "a,b", "--num-prompts", "4"]
    args = root.parse_args(argv)
    assert config_from_args(args).target.lora_models == ("a", "b")
