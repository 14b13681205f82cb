"""``common.memory_trim.MemoryTrimmer``: trims only past the slack, measures from where
the process is, and refuses a negative interval."""

from __future__ import annotations

import pytest

from common.memory_trim import REBASE_AFTER, MemoryTrimmer, resident_bytes


def _trimmed(slack: int) -> MemoryTrimmer:
    """A trimmer whose floor is a freshly trimmed heap: free pages an earlier test left
    resident would otherwise take the allocations below without growing the process.
    Skipped where the C library has no ``malloc_trim`` (not glibc): nothing to test there,
    and the trimmer is then off (``active`` is False)."""
    trimmer = MemoryTrimmer(interval_s=0, slack_bytes=slack)
    if trimmer._trim is None:  # noqa: SLF001
        pytest.skip("this C library has no malloc_trim (not glibc)")
    trimmer._trim(0)  # noqa: SLF001
    trimmer._floor = resident_bytes()  # noqa: SLF001
    return trimmer


def test_trims_once_the_process_grew_past_the_slack() -> None:
    trimmer = _trimmed(16 << 20)
    assert not trimmer.check_once()  # no growth: no trim
    # 64 MiB written (a zeroed allocation may be fresh, untouched pages that RSS does not
    # count yet; in a worker that freed big blocks before it came from the heap instead)
    blobs = [b"\x01" * (1 << 20) for _ in range(64)]
    assert trimmer.check_once() and trimmer.trims == 1
    del blobs
    assert not trimmer.check_once()  # the floor moved down with the freed memory


def test_a_burst_freed_in_two_steps_is_trimmed_twice() -> None:
    """A trim that returns memory while the rest of a burst is still held keeps its floor:
    the rest, freed later, is trimmed at the next look (it stayed in the arenas when the
    floor moved up to the half still held)."""
    trimmer = _trimmed(16 << 20)
    first, second = [], []
    for _ in range(512):  # 64 KiB blocks come from the heap, interleaved
        first.append(b"\x01" * (64 << 10))
        second.append(b"\x02" * (64 << 10))
    pin = b"\x03" * (64 << 10)  # above both halves: freeing them cannot shrink the heap's top
    del first
    assert trimmer.check_once()  # the first half's pages go back; the second is held
    del second
    assert trimmer.check_once() and trimmer.trims == 2
    assert pin


def test_a_burst_still_held_at_the_trim_is_returned_once_freed() -> None:
    """A trim that finds the burst still in use keeps the floor and tries again a look
    later: the burst, freed in between, goes back (it stayed in the arenas, 114 MiB, when
    the floor moved up to the burst: test_services_grpc_limits on CI's clean clone)."""
    trimmer = _trimmed(16 << 20)
    held = [b"\x01" * (64 << 10) for _ in range(1024)]  # 64 MiB of heap blocks
    pin = b"\x03" * (64 << 10)  # above them: freeing them cannot shrink the heap's top
    assert trimmer.check_once()  # trims, returns nothing: all of it is in use
    assert not trimmer.check_once()  # backs off one look
    held.clear()
    assert trimmer.check_once() and trimmer.trims == 2  # now it goes back
    assert not trimmer.check_once()  # within the slack of the floor again
    assert pin


def test_growth_that_stays_becomes_the_floor() -> None:
    """Memory in use for good is trimmed REBASE_AFTER times, less and less often, then
    taken as the process's size: no trim after that."""
    trimmer = _trimmed(16 << 20)
    floor = trimmer._floor  # noqa: SLF001
    kept = [b"\x01" * (64 << 10) for _ in range(1024)]
    looks = 0
    while trimmer._floor == floor:  # noqa: SLF001
        trimmer.check_once()
        looks += 1
        assert looks < 100, "the floor never moved"
    assert trimmer.trims == REBASE_AFTER and looks == 1 + 2 + 4 + 8 + 16
    assert not trimmer.check_once() and trimmer.trims == REBASE_AFTER
    assert kept


def test_interval_zero_is_off_and_negative_is_refused() -> None:
    assert not MemoryTrimmer(interval_s=0).active
    with pytest.raises(ValueError):
        MemoryTrimmer(interval_s=-1)


def test_resident_bytes_is_this_process() -> None:
    assert resident_bytes() > 1 << 20
