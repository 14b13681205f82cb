"""The Deployments' scale subresource through the ``kubernetes`` client.

Only ``get`` and ``patch`` on ``deployments/scale`` are used, which is what the chart's
RBAC grants. The client is blocking: each call runs in a worker thread under both the
client's own socket timeout and an asyncio deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from common.kube_client import make_api_client  # noqa: F401 - re-exported

T = TypeVar("T")


class ScaleError(RuntimeError):
    """Reading or patching a Deployment's scale failed."""


class DeploymentScaler:
    """Read and set ``spec.replicas`` of Deployments in one namespace."""

    def __init__(self, api_client: Any, namespace: str, timeout: float = 10.0) -> None:
        from kubernetes import client

        self._apps = client.AppsV1Api(api_client)
        self.namespace = namespace
        self.timeout = timeout

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(fn, *args, _request_timeout=self.timeout), self.timeout + 1.0
            )
        except Exception as exc:  # API status, transport error or deadline
            raise ScaleError(f"{what} in namespace {self.namespace}: {exc!r}") from exc

    async def get_replicas(self, name: str) -> int:
        scale = await self._call(
            f"read scale of deployment/{name}",
            self._apps.read_namespaced_deployment_scale,
            name,
            self.namespace,
        )
        spec = scale.spec
        return int(spec.replicas or 0) if spec is not None else 0

    async def set_replicas(self, name: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        await self._call(
            f"patch scale of deployment/{name}",
            self._apps.patch_namespaced_deployment_scale,
            name,
            self.namespace,
            {"spec": {"replicas": replicas}},
        )
