"""Command line of ``python -m autoscaler``; every flag has a ``PDSERVE_AUTOSCALER_*`` twin
(``--ttft-p90-target`` <-> ``PDSERVE_AUTOSCALER_TTFT_P90_TARGET``). A flag beats its env."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoscaler.policy import PoolLimits, SloTargets

ENV_PREFIX = "PDSERVE_AUTOSCALER_"


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    namespace: str
    prefill_deployment: str
    decode_deployment: str
    metrics_urls: tuple[str, ...] = ()
    metrics_dns: str = ""
    metrics_port: int = 8000
    kube_api_url: str = ""
    interval: float = 15.0
    scrape_timeout: float = 5.0
    api_timeout: float = 10.0
    dry_run: bool = False
    listen_host: str = "0.0.0.0"
    listen_port: int = 9100
    targets: SloTargets = field(default_factory=SloTargets)
    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)

    def __post_init__(self) -> None:
        if bool(self.metrics_urls) == bool(self.metrics_dns):
            raise ValueError("give exactly one of --metrics-urls or --metrics-dns")
        if not (self.namespace and self.prefill_deployment and self.decode_deployment):
            raise ValueError(
                "--namespace, --prefill-deployment and --decode-deployment are required"
            )
        if min(self.interval, self.scrape_timeout, self.api_timeout) <= 0:
            raise ValueError("--interval, --scrape-timeout and --api-timeout must be positive")
        for url in self.metrics_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"metrics URL {url!r} must start with http:// or https://")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r}")


# flag, type, default, help
_FLAGS: list[tuple[str, Callable[[str], Any], Any, str]] = [
    ("--namespace", str, "", "namespace of the two Deployments"),
    ("--prefill-deployment", str, "", "name of the prefill Deployment"),
    ("--decode-deployment", str, "", "name of the decode Deployment"),
    ("--metrics-urls", str, "", "comma-separated router /metrics URLs (static)"),
    ("--metrics-dns", str, "", "headless Service name of the routers; every address is scraped"),
    ("--metrics-port", int, 8000, "router HTTP port used with --metrics-dns"),
    ("--kube-api-url", str, "", "API server URL without auth (kubectl proxy); default in-cluster"),
    ("--interval", float, 15.0, "seconds between decisions (one metrics window)"),
    ("--scrape-timeout", float, 5.0, "deadline of one /metrics scrape, seconds"),
    ("--api-timeout", float, 10.0, "deadline of one Kubernetes API call, seconds"),
    ("--dry-run", _bool, False, "decide and log, never patch the Deployments"),
    ("--listen-host", str, "0.0.0.0", "address of the autoscaler's own /metrics"),
    ("--listen-port", int, 9100, "port of the autoscaler's own /metrics (0 = off)"),
    ("--ttft-p90-target", float, 1.0, "TTFT p90 SLO, seconds (drives prefill)"),
    ("--itl-p90-target", float, 0.05, "ITL p90 SLO, seconds (drives decode)"),
    ("--prefill-queue-target", float, 8.0, "waiting requests per prefill replica"),
    ("--decode-queue-target", float, 4.0, "waiting requests per decode replica"),
    ("--tolerance", float, 0.1, "scale up only above target x (1 + tolerance)"),
    ("--scale-down-ratio", float, 0.5, "scale down only below target x ratio"),
    ("--min-samples", int, 20, "latency samples a window needs to be judged"),
    ("--prefill-min", int, 1, "minimum prefill replicas"),
    ("--prefill-max", int, 8, "maximum prefill replicas"),
    ("--decode-min", int, 1, "minimum decode replicas"),
    ("--decode-max", int, 8, "maximum decode replicas"),
    ("--max-step-up", int, 2, "most replicas added to a pool in one decision"),
    ("--scale-up-cooldown", float, 60.0, "seconds after a pool scaled before it scales up"),
    ("--scale-down-cooldown", float, 300.0, "seconds after a pool scaled before it scales down"),
    ("--down-stable-windows", int, 3, "consecutive calm windows before a scale-down"),
]


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser; defaults come from ``env`` (os.environ by default)."""
    source = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="python -m autoscaler",
        description="Scale the pdserve prefill and decode Deployments from router SLO metrics.",
    )
    parser.add_argument("--log-level", default=source.get(env_name("--log-level"), "INFO"))
    for flag, kind, default, text in _FLAGS:
        name = env_name(flag)
        try:
            value = kind(source[name]) if name in source else default
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        parser.add_argument(flag, type=kind, default=value, help=f"{text} (env {name})")
    return parser


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[AutoscalerConfig, str]:
    """Flags + env -> (validated config, log level). Raises ValueError on bad input."""
    a = build_parser(env).parse_args(argv)
    urls = tuple(u.strip() for u in a.metrics_urls.split(",") if u.strip())
    cfg = AutoscalerConfig(
        namespace=a.namespace,
        prefill_deployment=a.prefill_deployment,
        decode_deployment=a.decode_deployment,
        metrics_urls=urls,
        metrics_dns=a.metrics_dns,
        metrics_port=a.metrics_port,
        kube_api_url=a.kube_api_url,
        interval=a.interval,
        scrape_timeout=a.scrape_timeout,
        api_timeout=a.api_timeout,
        dry_run=a.dry_run,
        listen_host=a.listen_host,
        listen_port=a.listen_port,
        targets=SloTargets(
            ttft_p90=a.ttft_p90_target,
            itl_p90=a.itl_p90_target,
            prefill_queue=a.prefill_queue_target,
            decode_queue=a.decode_queue_target,
            tolerance=a.tolerance,
            scale_down_ratio=a.scale_down_ratio,
            min_samples=a.min_samples,
        ),
        prefill=_limits(a, a.prefill_min, a.prefill_max),
        decode=_limits(a, a.decode_min, a.decode_max),
    )
    return cfg, str(a.log_level)


def _limits(a: argparse.Namespace, low: int, high: int) -> PoolLimits:
    return PoolLimits(
        min_replicas=low,
        max_replicas=high,
        max_step_up=a.max_step_up,
        scale_up_cooldown=a.scale_up_cooldown,
        scale_down_cooldown=a.scale_down_cooldown,
        down_stable_windows=a.down_stable_windows,
    )
