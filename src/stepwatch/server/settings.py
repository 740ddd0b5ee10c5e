"""The aggregator's settings that arrive as text (``--retention 7d``, ``STEPWATCH_*`` variables),
parsed here, apart from the server: ``stepwatch run`` checks them before it starts anything, and
importing the server would cost every launch asyncio's import."""

from __future__ import annotations

import logging
import os
import re

__all__ = ["RETENTION_ENV", "parse_duration", "positive_from_env"]

RETENTION_ENV = "STEPWATCH_RETENTION"  # how ``stepwatch run --retention`` reaches the aggregator it starts
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
log = logging.getLogger("stepwatch.aggregator")


def parse_duration(text: str) -> int:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"1.5h"`` (or plain seconds) in nanoseconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*", text.lower())
    if not found:
        raise ValueError(f"{text!r} is not a duration (a number and s, m, h, d or w, e.g. 7d or 12h)")
    value = float(found.group(1)) * _UNITS[found.group(2) or "s"]
    if value <= 0:
        raise ValueError(f"{text!r}: a retention window must be longer than 0")
    return int(value * 1e9)


def positive_from_env(name: str, default: float, unit: str = "seconds") -> float:
    """A positive number of ``unit`` from the environment (a bad value: the default, said once)."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        log.warning("%s=%r is not a positive number of %s: %g is used", name, text, unit, default)
        return default
    return value
