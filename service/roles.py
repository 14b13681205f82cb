"""The roles of a pdserve gRPC service, the one place a prefill and a decode instance differ
(docs/design.md §2). Everything else, the flags, the engine, the runtime and the RPCs both
answer, is the same for both (``service/runtime.py``, ``service/settings.py``,
``service/shared_rpcs.py``).

- ``prefill``: the engine as KV producer. It needs a KV connector to hand its KV to decode,
  and serves ``PrefillService`` and, over the same engine, ``DecodeService``: with no
  healthy decode instance the router has a prefill instance serve whole requests
  (docs/design.md §5, "Degrade, never drop").
- ``decode``: the engine as KV consumer, streaming tokens; serves ``DecodeService``.

Run one with ``pdserve prefill|decode`` or ``python -m service prefill|decode``; every flag
has a ``PDSERVE_*`` environment twin (see ``pdserve prefill --help``).
"""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass

import grpc.aio

from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from service.core import EngineServiceCore
from service.decode_servicer import DecodeServicer
from service.prefill_servicer import PrefillServicer
from service.runtime import run_service
from service.settings import add_service_arguments


@dataclass(frozen=True, slots=True)
class Role:
    """What sets one role apart."""

    name: str
    help: str  # the one line of `pdserve --help`
    serves_prefill: bool  # PrefillService besides DecodeService
    needs_connector: bool  # refuses --connector none


ROLES = {
    "prefill": Role(
        "prefill",
        "run one prefill gRPC service (engine as KV producer)",
        serves_prefill=True,
        needs_connector=True,
    ),
    "decode": Role(
        "decode",
        "run one decode gRPC service (KV consumer, token streams)",
        serves_prefill=False,
        needs_connector=False,
    ),
}


def add_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """Service, engine and KV connector flags of a service of ``role``."""
    from kv_store.factory import add_cli_arguments

    add_service_arguments(parser, role=ROLES[role].name)
    add_cli_arguments(parser)


def register(
    role: Role, server: grpc.aio.Server, core: EngineServiceCore, connector_name: str | None
) -> list[str]:
    """Add ``role``'s servicers to ``server``; the full names of the services added."""
    services = pdserve_pb2.DESCRIPTOR.services_by_name
    names = []
    if role.serves_prefill:
        kind = connector_name or "none"
        pdserve_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(core, kind), server)
        names.append(services["PrefillService"].full_name)
    pdserve_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(core), server)
    return [*names, services["DecodeService"].full_name]


def run(args: argparse.Namespace, role: str) -> int:
    """Entry point of `pdserve prefill|decode` (parsed flags in, exit status out)."""
    spec = ROLES[role]
    if spec.needs_connector and args.connector == "none":
        logging.getLogger(__name__).error(
            "a prefill service needs a KV connector to hand its KV to decode: pass --connector "
            "p2p or nixl, or fs|redis|lmcache with its --kv-path / --redis-url / --lmcache-url "
            "(env PDSERVE_CONNECTOR)"
        )
        return 2
    return run_service(args, role=spec.name, register=functools.partial(register, spec))


def main(argv: list[str] | None = None) -> int:
    """``python -m service ROLE [flags]``."""
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    roles = parser.add_subparsers(dest="role", required=True)
    for spec in ROLES.values():
        add_arguments(roles.add_parser(spec.name, help=spec.help), spec.name)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args, args.role)
