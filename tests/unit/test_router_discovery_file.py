"""``FileDiscovery``: the router follows a JSON instances file (what `pdserve up` rewrites
when it moves a service to new ports); a bad rewrite keeps the last good set."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from router.discovery.file import FileDiscovery


def _write(path: Path, data: object, bump: int) -> None:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    os.utime(path, ns=(bump, bump))  # a distinct mtime even within one clock tick


def test_follows_the_file_and_keeps_the_last_good_set(tmp_path: Path) -> None:
    path = tmp_path / "instances.json"
    _write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}, 10**9)
    seen: list[set[str]] = []

    async def scenario() -> None:
        found = FileDiscovery(path, "decode", interval=0.05, on_change=seen.append)
        stop = asyncio.Event()
        task = asyncio.create_task(found.run(stop))
        await asyncio.sleep(0.1)
        assert found.snapshot() == {"127.0.0.1:2"}
        _write(path, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:3", "[::1]:4"]}, 2 * 10**9)
        await asyncio.sleep(0.3)
        assert found.snapshot() == {"127.0.0.1:3", "[::1]:4"}
        _write(path, "{not json", 3 * 10**9)
        await asyncio.sleep(0.3)
        assert found.snapshot() == {"127.0.0.1:3", "[::1]:4"}
        path.unlink()
        await asyncio.sleep(0.3)
        assert found.snapshot() == {"127.0.0.1:3", "[::1]:4"}
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert seen == [{"127.0.0.1:3", "[::1]:4"}]


@pytest.mark.parametrize(
    "content", ["[]", '{"decode": "127.0.0.1:2"}', '{"decode": ["nohost"]}', "{"]
)
def test_a_bad_file_fails_at_startup(tmp_path: Path, content: str) -> None:
    path = tmp_path / "instances.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="instances"):
        FileDiscovery(path, "decode")
