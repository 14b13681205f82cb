"""Where a stop string ends a text: one rule for the engines' detokenizer
(engine/core/detokenizer.py) and the router's text after a failover (router/legs/resume_text.py),
so a resumed stream stops where the lost instance would have."""

from __future__ import annotations


def stop_end(text: str, stops: list[str], search_from: int, include_stop: bool) -> int | None:
    """The end of the kept text when a stop string occurs in ``text`` at or after
    ``search_from``, else None. The earliest occurrence wins (the longest on a tie); it is
    cut, or kept with ``include_stop`` (vLLM's ``include_stop_str_in_output``)."""
    hits = [(at, stop) for stop in stops if (at := text.find(stop, search_from)) >= 0]
    if not hits:
        return None
    at, found = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
    return at + len(found) if include_stop else at
