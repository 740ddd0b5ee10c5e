"""``stepwatch top``: the live view of a run started elsewhere (``init``, ``track``, another
terminal), read from its run directory until the run has ended."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...views.live import LiveReader, LiveSnapshot
from .table import REFRESH_S, render_view
from .text import PLAIN_EVERY_S, print_plain

__all__ = ["watch_run"]


def watch_run(run_dir: Path, console: Any, *, session_id: str | None = None, live: bool, once: bool = False,
              refresh_s: float = REFRESH_S, plain_every_s: float = PLAIN_EVERY_S,
              clock: Callable[[], float] = time.time) -> LiveSnapshot:
    """The view of ``run_dir`` until its run has ended (or Ctrl-C, which the caller takes); the
    last snapshot. ``once``: one frame and return. ``live``: the rich view, else plain lines."""
    reader = LiveReader(run_dir, session_id, clock=clock)
    try:
        snapshot = reader.snapshot()
        if once:
            console.print(render_view(snapshot))
            return snapshot
        if not live:
            print_plain(console, snapshot)
            return _until_ended(reader, snapshot, plain_every_s, lambda s: print_plain(console, s))
        from rich.live import Live

        with Live(render_view(snapshot), console=console, auto_refresh=False) as view:
            return _until_ended(reader, snapshot, refresh_s, lambda s: view.update(render_view(s), refresh=True))
    finally:
        reader.close()


def _until_ended(reader: LiveReader, snapshot: LiveSnapshot, period_s: float,
                 show: Callable[[LiveSnapshot], None]) -> LiveSnapshot:
    """A snapshot shown every ``period_s`` until one says the run has ended; that one."""
    while not snapshot.ended:
        time.sleep(period_s)
        snapshot = reader.snapshot()
        show(snapshot)
    return snapshot
