"""A prefill/decode pod that runs a pipeline stage other than the first (docs/kubernetes.md,
"Pipeline parallelism"): with ``--pipeline-stage`` k > 0 the service builds no engine and
serves no requests; it joins the group led at ``--pipeline-leader``
(``engine/executor/pp/join.py``) and runs stage k's layers for it until the leader stops.

Its gRPC port (and ``--grpc-health-port``) serves only ``grpc.health.v1``, NOT_SERVING
until the stage has joined and built its layers, SERVING while it runs, so the pods of a
group share one probe configuration. It exits 0 when the leader ends the group and 1 when
the group fails (the leader or another stage lost), and Kubernetes restarts it to rejoin.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.args import EngineArgs
from kv_store.args import KVStoreSettings
from service.settings import ServiceSettings

logger = logging.getLogger(__name__)

_ANY = ("", "0.0.0.0", "::", "[::]")


def run_stage(settings: ServiceSettings, engine_args: EngineArgs, store: KVStoreSettings) -> int:
    """Serve health and run the joined stage; the exit status."""
    from engine.executor.pp.join import join_stage

    config = engine_args.create_engine_config()  # ValueError: bad settings, exit 2
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for port in (settings.port, settings.grpc_health_port):
        if port:
            try:
                server.add_insecure_port(f"{settings.host}:{port}")
            except RuntimeError as exc:
                message = f"cannot listen on {settings.host}:{port} (in use?): {exc}"
                raise ValueError(message) from None
    server.start()

    def ready() -> None:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "pipeline stage %d of %d joined %s (pid-local health on :%d)",
            config.pipeline_stage,
            config.pipeline_parallel_size,
            config.pipeline_leader,
            settings.port,
        )

    # p2p pulls of this stage's KV come here: --p2p-host (the pod IP), else the listen
    # address when it is one, else the address this host has towards the leader.
    kv_host = store.p2p_host or (None if settings.host in _ANY else settings.host)
    try:
        status = join_stage(config, kv_host, ready)
        logger.info("pipeline stage %d: the leader ended the group", config.pipeline_stage)
    except Exception:
        logger.exception("pipeline stage %d failed", config.pipeline_stage)
        status = 1
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        server.stop(grace=None)
    return status
