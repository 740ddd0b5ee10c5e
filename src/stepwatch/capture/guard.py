"""Fail-open: stepwatch's own errors are logged once per site and swallowed, never raised into
user code. ``KeyboardInterrupt`` and ``SystemExit`` always pass (they are the user's).

Tests read ``swallowed()`` and fail on anything there, so a bug hidden by the guard still fails
the suite (STYLE habit 17).
"""

from __future__ import annotations

import errno
import logging
import sys
import threading
import traceback
from collections import Counter
from typing import Any

__all__ = ["guarded", "logger", "report_internal", "reset_swallowed", "swallowed"]

logger = logging.getLogger("stepwatch.internal")
_lock = threading.Lock()
_seen_sites: set[str] = set()
_counts: Counter[str] = Counter()
_recent: list[BaseException] = []
_RECENT_MAX = 64
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # every write fails alike after the first: one site, one line


def report_internal(exc: BaseException, site: str | None = None) -> None:
    """Counts a swallowed error and logs it the first time its site fails."""
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        site = "the run directory (disk full: what cannot be written is counted as dropped)"
    elif site is None:
        tb = exc.__traceback__
        frames = traceback.extract_tb(tb) if tb is not None else []
        site = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else type(exc).__name__
    with _lock:
        _counts[site] += 1
        if len(_recent) < _RECENT_MAX:
            _recent.append(exc)
        first = site not in _seen_sites
        _seen_sites.add(site)
    if first:
        try:
            sys.stderr.write(f"[stepwatch] internal error at {site} (logged once, training continues): "
                             f"{type(exc).__name__}: {exc}\n")
            logger.debug("internal error at %s", site, exc_info=exc)
        except Exception:  # noqa: BLE001 - a closed stderr must not break the host either
            pass


class _Guard:
    """A shared, allocation-free context manager: ``with guarded: ...``."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        if typ is None or not issubclass(typ, Exception):
            return False
        report_internal(exc)
        return True


guarded = _Guard()


def swallowed() -> dict[str, int]:
    """Swallowed-error counts by site (also written into the run's records)."""
    with _lock:
        return dict(_counts)


def recent_swallowed() -> list[BaseException]:
    with _lock:
        return list(_recent)


def reset_swallowed() -> None:
    with _lock:
        _counts.clear()
        _seen_sites.clear()
        _recent.clear()
