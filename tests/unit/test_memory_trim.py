"""``common.memory_trim.MemoryTrimmer``: trims only past the slack, measures from where
the process is, and refuses a negative interval."""

from __future__ import annotations

import pytest

from common.memory_trim import MemoryTrimmer, resident_bytes


def test_trims_once_the_process_grew_past_the_slack() -> None:
    trimmer = MemoryTrimmer(interval_s=0, slack_bytes=16 << 20)
    if trimmer._trim is None:  # noqa: SLF001
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # Start from a trimmed heap: free pages an earlier test left resident would otherwise
    # take the allocation below without growing the process.
    trimmer._trim(0)  # noqa: SLF001
    trimmer._floor = resident_bytes()  # noqa: SLF001
    assert not trimmer.check_once()  # no growth: no trim
    # 64 MiB written (a zeroed allocation may be fresh, untouched pages that RSS does not
    # count yet; in a worker that freed big blocks before it came from the heap instead)
    blobs = [b"\x01" * (1 << 20) for _ in range(64)]
    assert trimmer.check_once() and trimmer.trims == 1
    del blobs
    assert not trimmer.check_once()  # the floor moved down with the freed memory


def test_interval_zero_is_off_and_negative_is_refused() -> None:
    assert not MemoryTrimmer(interval_s=0).active
    with pytest.raises(ValueError):
        MemoryTrimmer(interval_s=-1)


def test_resident_bytes_is_this_process() -> None:
    assert resident_bytes() > 1 << 20
