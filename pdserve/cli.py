"""The `pdserve` command line. Each subcommand lives in its owner's module, which exposes
``add_parser(subparsers)``; those modules import heavy packages (torch) only when run, so
`pdserve router` stays torch-free."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from common.version import installed_version

# (module, attribute) of every subcommand registrar, in help order.
_REGISTRARS = [
    "pdserve.models:add_parser",
    "pdserve.launcher:add_parser",
    "pdserve.components:add_parser",
    "pdserve.bench:add_parser",
    "pdserve.tune:add_parser",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        help="logging level (env PDSERVE_LOG_LEVEL)",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {installed_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for spec in _REGISTRARS:
        module_name, attr = spec.split(":")
        getattr(importlib.import_module(module_name), attr)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
