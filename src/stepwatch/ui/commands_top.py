"""``stepwatch top RUN_DIR``: the live terminal view of a run started elsewhere (``stepwatch.init``,
``track``, ``run`` in another terminal), read from its run directory, or of a session of a
``serve --out`` directory, read from its history (docs/live-view.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .base import _console, _reports_errors

__all__ = ["top"]


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--session", "session_id",
              help="Session id (default: run.json's, else the newest ranks', else the history's newest).")
@click.option("--once", is_flag=True, help="Print the view once and exit.")
@click.option("--plain", is_flag=True, help="One plain line every --every seconds, even on a terminal.")
@click.option("--every", "every_s", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="Redraw period (default: 1 s live, 10 s plain).")
@_reports_errors
def top(run_dir: Path, session_id: str | None, once: bool, plain: bool, every_s: float | None) -> None:
    """Live view of the run in RUN_DIR: each rank's step, step time, rate, phases, memory and
    heartbeat, the progress, the primary verdict and the latest alerts.

    Ends once the run has ended (or on Ctrl-C). Not on a terminal (or with --plain): one plain
    line every 10 s, no escape codes."""
    from ..artifacts.live_ranks import require_run_dir
    from .live.table import REFRESH_S
    from .live.text import PLAIN_EVERY_S
    from .live.top import watch_run

    if not any((run_dir / name).exists() for name in ("ledger", "run.json", "history.sqlite")):
        require_run_dir(run_dir)  # no run.json, ledger or history: a heartbeat file at least, else a clear error
    console = _console()
    live = console.is_terminal and not console.is_dumb_terminal and not plain
    try:
        watch_run(run_dir, console, session_id=session_id, live=live, once=once,
                  refresh_s=every_s or REFRESH_S, plain_every_s=every_s or PLAIN_EVERY_S)
    except KeyboardInterrupt:
        sys.exit(130)
