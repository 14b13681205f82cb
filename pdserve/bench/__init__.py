"""`pdserve bench`: load generation and engine benchmarks.

PLACEHOLDER written by the bench-serve engineer only so that the `pdserve` CLI keeps working
(without this file `pdserve.bench` imports as a namespace package with no `add_parser`, and
`pdserve.cli` fails for every subcommand). The lead owns this file: replace it freely,
keeping the `add_serve_parser(subparsers)` call.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` command group and its subcommands."""
    from pdserve.bench.serve import add_serve_parser

    parser = subparsers.add_parser("bench", help="load generation and engine benchmarks")
    group = parser.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(group)
    return parser
