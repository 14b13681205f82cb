"""Summarize a py-spy profile of the serving path (``serving_overhead --profile``).

    python -m benchmarks.system.serving_profile PROFILE.txt [...] > summary.md

Reads py-spy's raw format (collapsed stacks, ``--threads --idle --subprocesses``) and, per
process and thread, says how many samples it had, what share of them it sat waiting
(a lock, a condition, ``select``), and where the rest went: the hottest leaf frames (self
time) and frames on the stack (inclusive), those of this project and its server libraries.
A sample whose leaf is ``Handle._run`` is time in C code a callback calls (gRPC's Cython
core, mostly), which py-spy cannot see into.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Leaves that mean a thread waits: a lock or condition, select, a queue; Thread.run as the
# leaf is C code under it (gRPC's poller in epoll); the benchmark's own stats writer sleeping.
WAITING = (
    "wait (threading.py", "select (selectors.py", "get (queue.py", "_idle (",
    "run (threading.py", "dump (benchmarks/system/serving_overhead_paths.py",
)  # fmt: skip
SHOWN = (
    "engine/", "service/", "router/", "grpc/", "starlette/", "uvicorn/", "fastapi/",
    "h11/", "httptools/", "json/", "asyncio/", "google/protobuf", "pdserve_api/",
)  # fmt: skip
_PROCESS = re.compile(r'^process \d+:"(?P<cmd>[^"]*)"$')


@dataclass(slots=True)
class ThreadProfile:
    samples: int = 0
    waiting: int = 0
    leaf: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)


def role(cmd: str) -> str:
    words = cmd.split()
    for name in ("router", "decode", "prefill", "up"):
        if name in words:
            return {"up": "launcher"}.get(name, name)
    return "service" if "--timed-service" in words else words[-1] if words else "?"


def function(frame: str) -> str:
    """``name (file.py:line)`` → ``name (file.py)``: lines of one function together."""
    return re.sub(r":\d+\)$", ")", frame)


def parse(lines: list[str]) -> dict[str, ThreadProfile]:
    """``role/thread`` → its profile (the last process frame names the role)."""
    out: dict[str, ThreadProfile] = defaultdict(ThreadProfile)
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, who, thread = stack.split(";"), "?", "?"
        while frames and (m := _PROCESS.match(frames[0])):
            who = role(m["cmd"])
            frames = frames[1:]
        if frames and frames[0].startswith("thread ("):
            thread = frames[0].split(": ", 1)[-1]
            frames = frames[1:]
        prof, n = out[f"{who}/{thread}"], int(count)
        prof.samples += n
        leaf = frames[-1] if frames else "?"
        if leaf.startswith(WAITING):
            prof.waiting += n
            continue
        prof.leaf[function(leaf)] += n
        for name in {function(f) for f in frames}:
            prof.inclusive[name] += n
    return out


def render(path: Path, profiles: dict[str, ThreadProfile], top: int) -> str:
    lines = [f"## {path.name}", ""]
    for key, prof in sorted(profiles.items(), key=lambda kv: -kv[1].samples):
        busy = prof.samples - prof.waiting
        if busy < 0.02 * max(p.samples for p in profiles.values()):
            continue
        lines += [
            f"### {key}: {prof.samples} samples, {prof.waiting / prof.samples:.0%} waiting",
            "",
            "| self | share of busy | frame |",
            "|---:|---:|---|",
        ]
        lines += [
            f"| {n} | {n / busy:.0%} | `{name[:110]}` |" for name, n in prof.leaf.most_common(top)
        ]
        shown = [
            (name, n)
            for name, n in prof.inclusive.most_common()
            if any(s in name for s in SHOWN) and n < busy
        ][:top]
        lines += ["", "| on stack | share of busy | frame |", "|---:|---:|---|"]
        lines += [f"| {n} | {n / busy:.0%} | `{name[:110]}` |" for name, n in shown]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("profiles", type=Path, nargs="+")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    for path in args.profiles:
        print(render(path, parse(path.read_text().splitlines()), args.top))  # CLI output
    return 0


if __name__ == "__main__":
    sys.exit(main())
