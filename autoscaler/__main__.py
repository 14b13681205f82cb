"""``python -m autoscaler``: run the SLO autoscaler until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import httpx
from prometheus_client import start_http_server

from autoscaler.config import AutoscalerConfig, parse_config
from autoscaler.controller import Autoscaler
from autoscaler.kube import DeploymentScaler, make_api_client
from autoscaler.metrics import AutoscalerMetrics

logger = logging.getLogger("autoscaler")


async def serve(cfg: AutoscalerConfig, stop: asyncio.Event) -> None:
    """Build the controller from ``cfg`` and run it until ``stop`` is set."""
    metrics = AutoscalerMetrics()
    if cfg.listen_port:
        server, thread = start_http_server(
            cfg.listen_port, cfg.listen_host, registry=metrics.registry
        )
    scaler = DeploymentScaler(
        make_api_client(cfg.kube_api_url or None), cfg.namespace, cfg.api_timeout
    )
    logger.info(
        "autoscaling %s/%s and %s/%s every %.0fs%s",
        cfg.namespace,
        cfg.prefill_deployment,
        cfg.namespace,
        cfg.decode_deployment,
        cfg.interval,
        " (dry run)" if cfg.dry_run else "",
    )
    try:
        async with httpx.AsyncClient() as http:
            await Autoscaler(cfg, scaler, http, metrics).run(stop)
    finally:
        if cfg.listen_port:
            server.shutdown()
            thread.join(5)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg, level = parse_config(argv)
    except ValueError as exc:
        logging.basicConfig(format="autoscaler: %(message)s")
        logging.getLogger(__name__).error("%s", exc)
        return 2
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(_run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
