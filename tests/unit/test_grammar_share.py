"""``engine.sampling.grammar_share.GrammarShare``: whole files only, per tokenizer, no
symlinks, a size cap, a failed check is a miss, off without a directory."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from engine.sampling.grammar_share import GrammarShare


def _ok(text: str) -> None:
    if not text.startswith("{"):
        raise ValueError("not a compiled grammar")


def test_round_trip_per_tokenizer(tmp_path: Path) -> None:
    one, two = GrammarShare(str(tmp_path), "tok-a"), GrammarShare(str(tmp_path), "tok-b")
    assert one.load("regex", "a+", _ok) is None
    one.store("regex", "a+", '{"g": 1}')
    assert one.load("regex", "a+", _ok) == '{"g": 1}'
    assert one.load("regex", "b+", _ok) is None  # another guide
    assert two.load("regex", "a+", _ok) is None  # another tokenizer
    assert not [p for p in tmp_path.rglob("*.tmp")]  # written under a temporary name


def test_bad_entries_are_misses(tmp_path: Path) -> None:
    share = GrammarShare(str(tmp_path), "tok", max_bytes=64)
    share.store("choice", "x", "garbage")
    assert share.load("choice", "x", _ok) is None  # the check refused it
    share.path("choice", "y").write_text("{" + "z" * 100)
    assert share.load("choice", "y", _ok) is None  # over the cap
    target = tmp_path / "elsewhere.json"
    target.write_text('{"g": 2}')
    os.symlink(target, share.path("choice", "z"))
    assert share.load("choice", "z", _ok) is None  # never through a link


def test_off_without_a_directory(tmp_path: Path) -> None:
    share = GrammarShare("", "tok")
    assert not share.enabled
    share.store("regex", "a", "{}")
    assert share.load("regex", "a", _ok) is None


def test_a_directory_that_cannot_be_made_costs_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    share = GrammarShare(str(blocker), "tok")  # its directory would sit under a file
    share.store("regex", "a", "{}")  # no exception: the other instances just compile
    assert share.load("regex", "a", _ok) is None


def test_entries_are_compact_and_bombs_are_misses(tmp_path: Path) -> None:
    share = GrammarShare(str(tmp_path), "tok", max_bytes=1 << 20)
    text = '{"rules": [' + ",".join(['{"a": 1, "b": [2, 3]}'] * 20_000) + "]}"
    share.store("json_schema", "s", text)
    assert share.path("json_schema", "s").stat().st_size < len(text) // 10
    assert share.load("json_schema", "s", _ok) == text
    share.path("json_schema", "bomb").write_bytes(zlib.compress(b"{" * (2 << 20)))
    assert share.load("json_schema", "bomb", _ok) is None  # inflates past the cap


def test_the_directory_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    blobs = {name: os.urandom(3000).hex() for name in "abcd"}  # about 3000 bytes packed
    probe = GrammarShare(str(tmp_path / "probe"), "tok")
    probe.store("regex", "a", "{" + blobs["a"])
    size = probe.path("regex", "a").stat().st_size
    share = GrammarShare(str(tmp_path), "tok", max_total_bytes=2 * size + size // 2)
    for i, name in enumerate("abc"):
        share.store("regex", name, "{" + blobs[name])
        os.utime(share.path("regex", name), (1000 + i, 1000 + i))  # a, then b, then c
    assert not share.path("regex", "a").exists()  # three did not fit: the oldest went
    assert share.load("regex", "b", _ok) is not None  # b is now the most recently used
    share.store("regex", "d", "{" + blobs["d"])
    assert share.path("regex", "b").exists() and share.path("regex", "d").exists()
    assert not share.path("regex", "c").exists()
