"""One byte-size rule for every flag that takes a size (docs/design.md §3, "Byte sizes").

Kubernetes quantities: ``Ki Mi Gi Ti`` are binary (2**10 ...), ``k K M G T`` decimal
(10**3 ...); a trailing ``B`` is allowed (``512MiB``, ``10GB``); a bare number is bytes.
``--kv-cache-memory 10G`` and ``--kv-capacity 10G`` therefore mean the same 10**10 bytes.
"""

from __future__ import annotations

import re

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_PATTERN = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*")


def parse_bytes(text: str | int) -> int:
    """``"10GiB"`` → 10 * 2**30, ``"512M"`` → 512 * 10**6, ``"1e9"``, ``1000`` → bytes.

    Raises ``ValueError`` with an example on anything else, or on a negative size.
    """
    if isinstance(text, bool):
        raise ValueError(f"invalid byte size {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(
                f"invalid byte size {text!r} (examples: 1073741824, 512Mi, 2GiB, 10G = 10**10)"
            )
        unit = (match.group(2) or "").lower()
        scale = _BINARY.get(unit) or _DECIMAL[unit]
        value = int(float(match.group(1)) * scale)
    if value < 0:
        raise ValueError(f"byte size must be >= 0, got {text!r}")
    return value


def format_bytes(value: int) -> str:
    """The shortest exact binary spelling (``1GiB``), or plain bytes."""
    for unit, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if value and value % scale == 0:
            return f"{value // scale}{unit}B"
    return str(value)
