"""The ``stepwatch`` logger of the long-running parts (aggregator, store), and the one switch
that sends it to stderr.

A library does not choose where its log lines go: ``stepwatch.server`` and ``stepwatch.store``
only log, at WARNING for what an operator must see. The entries that run them as a program
(``python -m stepwatch.server``, ``stepwatch serve`` and ``stepwatch run``, which call
``serve``) call :func:`log_to_stderr`, so their lines reach stderr as ``[stepwatch] ...``, as
the launcher's own lines do. A program that embeds the store and configured nothing still sees
them through Python's last-resort handler (the message alone, on stderr).

The training process's fail-open guard (``stepwatch.guard``) writes its one line per site to
stderr itself: there the user's program owns the logging configuration.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["log_to_stderr", "logger"]

logger = logging.getLogger("stepwatch")


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each record (a replaced stderr, e.g. in tests)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def log_to_stderr(level: int = logging.INFO) -> None:
    """Sends the ``stepwatch`` logger to stderr as ``[stepwatch] <message>``; once per process."""
    if any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("[stepwatch] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(min(logger.level or level, level))
