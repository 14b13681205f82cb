"""Routing policies (docs/design.md §5): pick one instance of a pool for a request.

A policy sees only healthy candidates (the pool filters) and never mutates them. Each pool
(prefill, decode) gets its own policy object, chosen by ``--prefill-policy`` /
``--decode-policy``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.prefix_index import PrefixIndex

POLICY_NAMES = ("least_load", "round_robin", "prefix_aware", "session")


class Candidate(Protocol):
    """What a policy needs to know about an instance."""

    @property
    def url(self) -> str: ...

    def load_score(self) -> float:
        """waiting × 4 + running (from the last GetLoad) + requests sent since then."""
        ...


@dataclass(slots=True)
class RouteContext:
    """Per-request routing inputs."""

    block_hashes: Sequence[bytes] = ()
    user: str | None = None


class Policy(Protocol):
    name: str

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        """Pick one of ``candidates`` (non-empty)."""
        ...


def _least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    # Ties go to the lowest URL so the choice is deterministic.
    return min(candidates, key=lambda c: (c.load_score(), c.url))


class LeastLoadPolicy:
    name = "least_load"

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        return _least_loaded(candidates)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.url)
        return ordered[next(self._counter) % len(ordered)]


class PrefixAwarePolicy:
    """Prefer the instance holding the longest leading run of the prompt's blocks.

    Falls back to least load when no instance holds any block, or when the best-matching
    instance is overloaded relative to the least loaded one (``score > min × skew_ratio +
    skew_slack``): a hot prefix must not pile every request onto one instance.
    """

    name = "prefix_aware"

    def __init__(
        self, index: PrefixIndex, *, skew_ratio: float = 2.0, skew_slack: float = 8.0
    ) -> None:
        self.index = index
        self.skew_ratio = skew_ratio
        self.skew_slack = skew_slack

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        least = _least_loaded(candidates)
        if not ctx.block_hashes:
            return least
        best, best_blocks = least, 0
        for cand in sorted(candidates, key=lambda c: (c.load_score(), c.url)):
            blocks = self.index.matched_blocks(cand.url, ctx.block_hashes)
            if blocks > best_blocks:
                best, best_blocks = cand, blocks
        if best_blocks == 0:
            return least
        if best.load_score() > least.load_score() * self.skew_ratio + self.skew_slack:
            return least
        return best


@dataclass(slots=True)
class _Ring:
    urls: tuple[str, ...] = ()
    points: list[int] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)


def _point(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class SessionPolicy:
    """Consistent hashing of the request's ``user`` onto the healthy instances.

    A user keeps its instance while the pool changes elsewhere (only ~1/N of users move when
    an instance joins or leaves). Requests without a user go to the least loaded instance.
    """

    name = "session"

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._ring = _Ring()

    def _ring_for(self, urls: tuple[str, ...]) -> _Ring:
        if urls != self._ring.urls:
            pairs = sorted((_point(f"{url}#{i}"), url) for url in urls for i in range(self.vnodes))
            self._ring = _Ring(urls, [p for p, _ in pairs], [u for _, u in pairs])
        return self._ring

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        if not ctx.user:
            return _least_loaded(candidates)
        by_url = {c.url: c for c in candidates}
        ring = self._ring_for(tuple(sorted(by_url)))
        i = bisect.bisect(ring.points, _point(ctx.user)) % len(ring.points)
        return by_url[ring.owners[i]]


def make_policy(name: str, index: PrefixIndex) -> Policy:
    """Build the policy called ``name`` (one of :data:`POLICY_NAMES`)."""
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(index)
    if name == "session":
        return SessionPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
