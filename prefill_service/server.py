"""`pdserve prefill`: the prefill gRPC service process (engine as KV producer).

Run it with ``python -m prefill_service.server`` or ``pdserve prefill``; every flag has a
``PDSERVE_*`` environment twin (see ``pdserve prefill --help``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import grpc.aio

from engine_service.core import EngineServiceCore
from engine_service.decode_servicer import DecodeServicer
from engine_service.runtime import run_service
from engine_service.settings import add_service_arguments
from pdserve_api.v1 import pdserve_pb2, pdserve_pb2_grpc
from prefill_service.servicer import PrefillServicer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Service, engine and KV connector flags of the prefill service."""
    from kv_store.factory import add_cli_arguments

    add_service_arguments(parser, role="prefill")
    add_cli_arguments(parser)


def register(server: grpc.aio.Server, core: EngineServiceCore, connector: Any) -> list[str]:
    """PrefillService, and DecodeService over the same engine: with no healthy decode
    instance the router has a prefill instance serve whole requests (docs/design.md §5,
    "Degrade, never drop")."""
    name = getattr(connector, "name", "none") if connector is not None else "none"
    pdserve_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(core, name), server)
    pdserve_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(core), server)
    services = pdserve_pb2.DESCRIPTOR.services_by_name
    return [services["PrefillService"].full_name, services["DecodeService"].full_name]


def run(args: argparse.Namespace) -> int:
    """Entry point of `pdserve prefill` (parsed flags in, exit status out)."""
    if args.connector == "none":
        logging.getLogger(__name__).error(
            "a prefill service needs a KV connector to hand its KV to decode: pass --connector "
            "p2p, or fs|redis|lmcache with its --kv-path / --redis-url / --lmcache-url "
            "(env PDSERVE_CONNECTOR)"
        )
        return 2
    return run_service(args, role="prefill", register=register)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
