"""`pdserve decode`: the decode gRPC service process (engine as KV consumer, token streams).

Run it with ``python -m decode_service.server`` or ``pdserve decode``; every flag has a
``PDSERVE_*`` environment twin (see ``pdserve decode --help``).
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Service, engine and KV connector flags of the decode service."""
    from kv_store.factory import add_cli_arguments

    add_service_arguments(parser, role="decode")
    add_cli_arguments(parser)


def register(server: grpc.aio.Server, core: EngineServiceCore, connector: Any) -> list[str]:
    pdserve_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(core), server)
    return [pdserve_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


def run(args: argparse.Namespace) -> int:
    """Entry point of `pdserve decode` (parsed flags in, exit status out)."""
    return run_service(args, role="decode", register=register)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
