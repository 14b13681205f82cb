"""The installed pdserve's version (``pdserve --version``, the router's ``GET /version``)."""

from __future__ import annotations

import importlib.metadata


def installed_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"
