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

from router.routing.kv_index import Match

POLICY_NAMES = ("least_load", "round_robin", "prefix_aware", "session")


class Candidate(Protocol):
    """What a policy needs to know about an instance."""

    @property
    def url(self) -> str: ...

    def load_score(self) -> float:
        """waiting × 4 + running (from the last GetLoad) + requests sent since then."""
        ...


@dataclass(slots=True)
class RouteNote:
    """Why a policy picked what it picked (the request's trace and
    ``pdserve_route_choices_total``): ``prefix_events`` / ``prefix_routed`` (events and
    recent routes, ``router/routing/prefix_match.py``) / ``prefix_guess`` (its held blocks won), ``load`` (no hit worth its load), ``skewed`` (the best hit was much busier than
    the least loaded), ``policy`` (a policy that does not look at prefixes), ``pinned``
    (placement chose the instance: decode-first, auto mode)."""

    reason: str
    match: Match | None = None
    score: float | None = None


@dataclass(slots=True)
class RouteContext:
    """Per-request routing inputs (and the policy's note on its choice)."""

    block_hashes: Sequence[bytes] = ()
    user: str | None = None
    lora_name: str | None = None  # the LoRA adapter the request runs with (router/lora.py)
    pin: str | None = None  # placement already chose this instance (while it is healthy)
    note: RouteNote | None = None  # set by the last ``select``


class PrefixMatcher(Protocol):
    """Per-instance prefix hits (``router/routing/prefix_match.py``)."""

    def matches(self, urls: Sequence[str], hashes: Sequence[bytes]) -> dict[str, Match]: ...


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
        ctx.note = RouteNote("policy")
        return _least_loaded(candidates)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.url)
        ctx.note = RouteNote("policy")
        return ordered[next(self._counter) % len(ordered)]


class PrefixAwarePolicy:
    """Score each instance by the prompt's leading blocks it holds, weighted by tier,
    against its load: ``score = weighted hit blocks − load_weight × load_score``; the best
    score wins (ties: less load, then URL). ``load_weight`` 1.0 (one held block per unit of
    load) was tuned on ``benchmarks/system/kv_routing.py``: at 4.0 a conversation's next turn
    left the instance holding it whenever the loads differed by one request.

    Hits come from the event index where the instance's stream is live, else from the
    guessing index (``matcher``). Least load also wins when the winner is overloaded
    relative to the least loaded instance (``load > min × skew_ratio + skew_slack``): a hot
    prefix must not pile every request onto one instance.
    """

    name = "prefix_aware"

    def __init__(
        self,
        matcher: PrefixMatcher,
        *,
        load_weight: float = 1.0,
        skew_ratio: float = 2.0,
        skew_slack: float = 8.0,
    ) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.matcher = matcher
        self.load_weight = load_weight
        self.skew_ratio = skew_ratio
        self.skew_slack = skew_slack

    def select(self, candidates: Sequence[Candidate], ctx: RouteContext) -> Candidate:
        least = _least_loaded(candidates)
        if not ctx.block_hashes:
            ctx.note = RouteNote("load")
            return least
        matches = self.matcher.matches([c.url for c in candidates], ctx.block_hashes)
        best, best_score = least, float("-inf")
        for cand in sorted(candidates, key=lambda c: (c.load_score(), c.url)):
            score = matches[cand.url].weighted - self.load_weight * cand.load_score()
            if score > best_score:
                best, best_score = cand, score
        match = matches[best.url]
        if match.blocks == 0:
            ctx.note = RouteNote("load", matches[least.url], best_score)
            return least
        if best.load_score() > least.load_score() * self.skew_ratio + self.skew_slack:
            ctx.note = RouteNote("skewed", matches[least.url])
            return least
        ctx.note = RouteNote(f"prefix_{match.source}", match, best_score)
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
        ctx.note = RouteNote("policy")
        if not ctx.user:
            return _least_loaded(candidates)
        by_url = {c.url: c for c in candidates}
        ring = self._ring_for(tuple(sorted(by_url)))
        i = bisect.bisect(ring.points, _point(ctx.user)) % len(ring.points)
        return by_url[ring.owners[i]]


def make_policy(name: str, matcher: PrefixMatcher, load_weight: float = 1.0) -> Policy:
    """Build the policy called ``name`` (one of :data:`POLICY_NAMES`); ``matcher`` and
    ``load_weight`` are ``prefix_aware``'s."""
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(matcher, load_weight=load_weight)
    if name == "session":
        return SessionPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
