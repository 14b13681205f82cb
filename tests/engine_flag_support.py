"""A check shared by the tests of engine flags: a service command line sets the engine field,
its default holds when unset, a bad value is refused, and `pdserve up` forwards it."""

from __future__ import annotations

from pathlib import Path

import pytest


def check_engine_flag(
    model_dir: Path, flag: str, value: str, field_name: str, default: object, bad: str, *base: str
) -> None:
    """A decode service's ``flag value`` (after ``--model model_dir`` and ``base``) sets
    ``EngineConfig.field_name`` to ``value``, leaving it out gives ``default``, ``bad`` is
    refused, and ``pdserve up`` forwards ``flag value`` (and nothing when it is unset)."""
    import argparse

    from service.settings import (
        add_forwarded_engine_arguments,
        add_service_arguments,
        engine_config_from_args,
        forward_engine_flags,
    )

    service = argparse.ArgumentParser()
    add_service_arguments(service, role="decode")
    argv = ["--model", str(model_dir), *base]
    set_ = engine_config_from_args(service.parse_args([*argv, flag, value]))
    assert getattr(set_, field_name) == value
    assert getattr(engine_config_from_args(service.parse_args(argv)), field_name) == default
    with pytest.raises(SystemExit):
        service.parse_args([*argv, flag, bad])
    up = argparse.ArgumentParser()
    add_forwarded_engine_arguments(up)
    words = forward_engine_flags(up.parse_args([flag, value]))
    assert words[words.index(flag) + 1] == value
    assert flag not in forward_engine_flags(up.parse_args([]))
