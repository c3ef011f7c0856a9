"""Sizes as people write them (`1GiB`, `512MiB`, `64M`) and as the limits' messages show them."""

from __future__ import annotations

import math
import re

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
         "ti": 2**40, "tib": 2**40}
SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)", re.IGNORECASE)


def parse_size(text: str | int | float) -> int:
    """Bytes from `1GiB`, `512MiB`, `64M` (1000-based: k, M, G, T; 1024-based: Ki, Mi, Gi, Ti, with or without
    a B) or a number of bytes; ValueError otherwise."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = SIZE.fullmatch(text.strip())
        if not match or match.group(2).lower() not in UNITS:
            raise ValueError(text)
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return int(value * UNITS[unit])


def format_size(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps at most one decimal: 1GiB, 1.5GiB, 256MiB, 100B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and (n * 10) % size == 0:
            return f"{n / size:g}{unit}"
    return f"{n}B"
