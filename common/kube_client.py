"""The Kubernetes API client that the router's discovery and the autoscaler both build."""

from __future__ import annotations

from typing import Any


def make_api_client(api_url: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: in-cluster config when running in a pod, else
    ``api_url`` (e.g. ``kubectl proxy``'s http://127.0.0.1:8001, tests), else ~/.kube/config.
    ``kubernetes`` is imported here, so importing this module does not need it."""
    from kubernetes import client, config

    if api_url:
        cfg = client.Configuration()
        cfg.host = api_url.rstrip("/")
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
