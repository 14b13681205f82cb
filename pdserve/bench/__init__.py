"""`pdserve bench`: load generation (`serve`) and offline engine benchmarks
(`throughput`, `latency`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` command group and its subcommands."""
    from pdserve.bench.offline import add_offline_parsers
    from pdserve.bench.serve import add_serve_parser

    parser = subparsers.add_parser("bench", help="load generation and engine benchmarks")
    group = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(group)
    add_offline_parsers(group)
    return parser
