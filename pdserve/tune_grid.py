"""The pure half of `pdserve tune`: the grid, the resumable results file, the choice of the
best configuration, and the Helm values that deploy it. No processes, no network.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
MODES = ("colocated", "disaggregated", "auto")


@dataclass(slots=True, frozen=True)
class GridPoint:
    """One `pdserve up` configuration."""

    mode: str
    prefill: int
    decode: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Per-pool tensor-parallel sizes (``pdserve up --prefill-tensor-parallel-size``, ...):
    # the decode re-cuts the prefill's KV (docs/design.md §3 "KV between unlike grids").
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def key(self) -> str:
        """Stable identity used in the results file (a split of TP 1 on both pools keeps
        the key it had before splits were a dimension)."""
        key = (
            f"{self.mode}:p{self.prefill}:d{self.decode}:"
            f"seqs={self.max_num_seqs or 'default'}:tokens={self.max_num_batched_tokens or 'default'}"
        )
        if (self.prefill_tp, self.decode_tp) != (1, 1):
            key += f":tp={self.prefill_tp}/{self.decode_tp}"
        return key

    @property
    def devices(self) -> int:
        """GPUs (on the CPU: gloo rank processes) the configuration's engines use."""
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        """Short human label, e.g. `1P+1D disagg seqs=16`."""
        shape = (
            f"{self.decode}x colocated"
            if self.mode == "colocated"
            else (f"{self.prefill}P+{self.decode}D {self.mode[:6]}")
        )
        extra = "".join(
            f" {name}={value}"
            for name, value in (("seqs", self.max_num_seqs), ("tok", self.max_num_batched_tokens))
            if value is not None
        )
        if (self.prefill_tp, self.decode_tp) != (1, 1):
            extra += (
                f" tp=D{self.decode_tp}"
                if self.mode == "colocated"
                else f" tp=P{self.prefill_tp}/D{self.decode_tp}"
            )
        return shape + extra

    def up_args(self) -> list[str]:
        """The `pdserve up` flags for this configuration."""
        args = ["--mode", self.mode, "--prefill", str(self.prefill), "--decode", str(self.decode)]
        if (self.prefill_tp, self.decode_tp) != (1, 1):
            if self.prefill:
                args += ["--prefill-tensor-parallel-size", str(self.prefill_tp)]
            args += ["--decode-tensor-parallel-size", str(self.decode_tp)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return args


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """`"1:1,1:3"` -> [(1, 1), (1, 3)]: prefill:decode proportions, both >= 1."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.partition(":")
        try:
            pa, pb = int(a), int(b)
        except ValueError:
            raise ValueError(f"bad ratio {part!r}: expected P:D, e.g. 1:3") from None
        if not sep or pa < 1 or pb < 1:
            raise ValueError(f"bad ratio {part!r}: expected P:D with both >= 1")
        out.append((pa, pb))
    return out


def splits(instances: int, ratios: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """(prefill, decode) splits of `instances` with both pools >= 1; `ratios` filters them
    to the exact proportions asked for (a ratio that does not divide `instances` is an error)."""
    if ratios is None:
        return [(p, instances - p) for p in range(1, instances)]
    out = []
    for a, b in ratios:
        if instances % (a + b):
            raise ValueError(f"ratio {a}:{b} does not split {instances} instances exactly")
        k = instances // (a + b)
        out.append((a * k, b * k))
    return out


def tp_pairs(
    mode: str, prefill_sizes: Sequence[int], decode_sizes: Sequence[int]
) -> list[tuple[int, int]]:
    """(prefill TP, decode TP) pairs to try for one mode: every pair (each side's sizes
    already checked against the model: ``pdserve/tune.py``); colocated has no prefill
    pool, so only the decode's sizes (prefill TP 1)."""
    if mode == "colocated":
        return [(1, d) for d in dict.fromkeys(decode_sizes)]
    return list(itertools.product(dict.fromkeys(prefill_sizes), dict.fromkeys(decode_sizes)))


def build_grid(
    instances: int,
    modes: Sequence[str],
    ratios: Sequence[tuple[int, int]] | None = None,
    max_num_seqs: Sequence[int | None] = (None,),
    max_num_batched_tokens: Sequence[int | None] = (None,),
    prefill_tp: Sequence[int] = (1,),
    decode_tp: Sequence[int] = (1,),
    device_budget: int | None = None,
) -> list[GridPoint]:
    """Every configuration to try: colocated uses all instances as decode (prefill 0);
    disaggregated and auto try each prefill:decode split; each with every per-pool TP
    pair. ``device_budget``: drop the points whose engines need more GPUs (CPU: rank
    processes) than that. Raises ValueError when empty."""
    if instances < 1:
        raise ValueError(f"--instances must be >= 1, got {instances}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad}; choose from {MODES}")
    if min((*prefill_tp, *decode_tp), default=1) < 1:
        raise ValueError("tensor-parallel sizes must be >= 1")
    shapes: list[tuple[str, int, int, int, int]] = []
    for mode in dict.fromkeys(modes):
        pairs = tp_pairs(mode, prefill_tp, decode_tp)
        if mode == "colocated":
            shapes += [(mode, 0, instances, a, b) for a, b in pairs]
        else:
            shapes += [(mode, p, d, a, b) for p, d in splits(instances, ratios) for a, b in pairs]
    grid = [
        GridPoint(mode, p, d, seqs, toks, a, b)
        for (mode, p, d, a, b), seqs, toks in itertools.product(
            shapes, dict.fromkeys(max_num_seqs), dict.fromkeys(max_num_batched_tokens)
        )
    ]
    if not grid:
        raise ValueError(
            f"empty grid: {instances} instance(s) cannot be split into prefill and decode pools"
        )
    fits = [point for point in grid if device_budget is None or point.devices <= device_budget]
    if not fits:
        raise ValueError(
            f"empty grid: every configuration needs more than the {device_budget} GPUs given "
            f"(the smallest needs {min(point.devices for point in grid)})"
        )
    return fits


def bench_fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of everything that makes results comparable (workload, load, SLOs)."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(slots=True)
class ResultsFile:
    """`results.jsonl`: one line per finished (configuration, rate); append-only, so a
    killed tune loses at most the point it was running. Lines from another workload
    (other fingerprint) and failed points are not counted as finished."""

    path: Path
    fingerprint: str

    def load(self) -> dict[tuple[str, float], dict[str, Any]]:
        """Finished entries by (point key, rate); later lines win; a torn last line is skipped."""
        return {k: row for k, row in self.load_latest().items() if row.get("status") == "ok"}

    def load_latest(self) -> dict[tuple[str, float], dict[str, Any]]:
        """The latest entry of this workload per (point key, rate), finished or failed."""
        done: dict[tuple[str, float], dict[str, Any]] = {}
        if not self.path.exists():
            return done
        for lineno, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (str(row["key"]), float(row["rate"]))
            except (ValueError, KeyError, TypeError):
                log.warning("%s:%d: unreadable line skipped", self.path, lineno)
                continue
            if row.get("fingerprint") == self.fingerprint:
                done[key] = row
        return done

    def append(self, row: dict[str, Any]) -> None:
        row = {**row, "fingerprint": self.fingerprint}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=_json_default) + "\n")
            fh.flush()


def _json_default(obj: object) -> object:
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def point_row(point: GridPoint, rate: float, status: str, **extra: Any) -> dict[str, Any]:
    """A results line for one (configuration, rate)."""
    return {"key": point.key, "rate": rate, "status": status, "point": asdict(point), **extra}


def best_row(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished row with the highest goodput (ties: higher request throughput)."""

    def score(row: dict[str, Any]) -> tuple[float, float]:
        s = row["summary"]
        return (s.get("goodput") or 0.0, s.get("request_throughput") or 0.0)

    ok = [r for r in rows if r.get("status") == "ok"]
    return max(ok, key=score) if ok else None


def helm_values(point: GridPoint) -> str:
    """The Helm values snippet that deploys `point` (keys of the pdserve chart)."""
    split = (point.prefill_tp, point.decode_tp) != (1, 1)
    lines = [
        "# pdserve tune: best configuration",
        "prefill:",
        f"  replicas: {point.prefill}",
        *([f"  tensorParallelSize: {point.prefill_tp}"] if split and point.prefill else []),
        "decode:",
        f"  replicas: {point.decode}",
        *([f"  tensorParallelSize: {point.decode_tp}"] if split else []),
        "router:",
        f"  mode: {point.mode}",
    ]
    engine = [
        f"  {key}: {value}"
        for key, value in (
            ("maxNumSeqs", point.max_num_seqs),
            ("maxNumBatchedTokens", point.max_num_batched_tokens),
        )
        if value is not None
    ]
    # An empty `engine:` would be null and would wipe the chart's defaults: leave it out.
    lines += ["engine:", *engine] if engine else ["# engine: chart defaults"]
    return "\n".join(lines) + "\n"
