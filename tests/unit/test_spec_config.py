"""Parsing of the ``speculative`` setting and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config.speculative import SpeculativeConfig, parse_speculative


def test_ngram_defaults_and_options() -> None:
    assert parse_speculative("ngram") == SpeculativeConfig("ngram", k=4, n=4, min_n=1)
    assert parse_speculative("ngram:k=2,n=3,min_n=2") == SpeculativeConfig(
        "ngram", k=2, n=3, min_n=2
    )
    assert parse_speculative(" ngram:k=7 ") == SpeculativeConfig("ngram", k=7)


def test_draft_options(tmp_path: Path) -> None:
    cfg = parse_speculative(f"draft:model={tmp_path},k=3,num_blocks=64")
    assert cfg == SpeculativeConfig("draft", k=3, model=str(tmp_path), num_blocks=64)


@pytest.mark.parametrize(
    "text, message",
    [
        ("eagle:k=4", "unknown method 'eagle'"),
        ("ngram:k=0", r"k must be in \[1, 16\]"),
        ("ngram:k=x", "k must be an integer"),
        ("ngram:k", "is not key=value"),
        ("ngram:k=2,k=3", "given twice"),
        ("ngram:model=/x", "unknown option 'model' for ngram"),
        ("ngram:n=2,min_n=3", r"min_n must be in \[1, 2\]"),
        ("draft:k=4", "draft needs model=PATH"),
        ("draft:model=/definitely/not/here", "is not a directory"),
    ],
)
def test_errors_are_clear(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative(text)


def test_engine_config_validates_speculative(tiny_model_dir: Path) -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="speculative: unknown method"):
        EngineConfig(model=str(tiny_model_dir), speculative="magic")
    cfg = EngineConfig(model=str(tiny_model_dir), speculative="ngram:k=3")
    assert cfg.speculative_config() == SpeculativeConfig("ngram", k=3)
    assert EngineConfig(model=str(tiny_model_dir)).speculative_config() is None
