"""`pdserve router | prefill | decode`: one component per process (what Kubernetes runs).

Every flag has a ``PDSERVE_*`` environment twin (``--max-num-seqs`` ← PDSERVE_MAX_NUM_SEQS).
Registering the subcommands imports no torch: the services load their engine only when run,
so `pdserve router` stays a small CPU process.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def _run_service(args: argparse.Namespace) -> int:
    from service.roles import run

    return run(args, args.command)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the three component subcommands (router only when ``router.cli`` exists)."""
    from service.roles import ROLES, add_arguments

    for role in ROLES.values():  # prefill, decode
        parser = subparsers.add_parser(role.name, help=role.help)
        add_arguments(parser, role.name)
        parser.set_defaults(func=_run_service)

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
