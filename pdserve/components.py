"""`pdserve router | prefill | decode`: one component per process (what Kubernetes runs).

Every flag has a ``PDSERVE_*`` environment twin (``--max-num-seqs`` ← PDSERVE_MAX_NUM_SEQS).
Registering the subcommands imports no torch: the services load their engine only when run,
so `pdserve router` stays a small CPU process.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def _run_prefill(args: argparse.Namespace) -> int:
    from prefill_service.server import run

    return run(args)


def _run_decode(args: argparse.Namespace) -> int:
    from decode_service.server import run

    return run(args)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the three component subcommands (router only when ``router.cli`` exists)."""
    from decode_service.server import add_arguments as add_decode_arguments
    from prefill_service.server import add_arguments as add_prefill_arguments

    prefill = subparsers.add_parser(
        "prefill", help="run one prefill gRPC service (engine as KV producer)"
    )
    add_prefill_arguments(prefill)
    prefill.set_defaults(func=_run_prefill)

    decode = subparsers.add_parser(
        "decode", help="run one decode gRPC service (KV consumer, token streams)"
    )
    add_decode_arguments(decode)
    decode.set_defaults(func=_run_decode)

    try:
        from router.cli import add_router_arguments, run_router
    except ModuleNotFoundError as exc:
        if exc.name not in ("router", "router.cli"):
            raise
        logger.debug("router.cli is not in this checkout; `pdserve router` is unavailable")
        return
    router = subparsers.add_parser("router", help="run the OpenAI-compatible HTTP router")
    add_router_arguments(router)
    router.set_defaults(func=run_router)
