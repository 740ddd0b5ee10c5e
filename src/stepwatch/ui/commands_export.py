"""``stepwatch export``: a run's history in another tool's format. ``export perfetto`` writes the
Trace Event Format JSON that ui.perfetto.dev and ``chrome://tracing`` open (docs/export.md).

Exit codes: 0 written; 2 the input cannot be read, the selection matches nothing, or the
command line is wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .base import _console, _reports_errors, _soft_wrap

__all__ = ["export"]


def _steps(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    from ..exports.selection import parse_steps

    try:
        return parse_steps(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _ranks(_ctx: click.Context, _param: click.Parameter, value: str | None) -> frozenset[int] | None:
    if value is None:
        return None
    from ..exports.selection import parse_ranks

    try:
        return parse_ranks(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group()
def export() -> None:
    """Write a run's history in another tool's format (docs/export.md)."""


@export.command("perfetto")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", default=None, metavar="FILE",
              help="Where to write the trace (default: RUN_DIR/trace.json; - for standard output; a name ending .gz: gzip-compressed).")
@click.option("--steps", callback=_steps, metavar="A:B",
              help="Only steps A to B-1 (A:, :B and N too), on each rank from its step A's start to its step B-1's end.")
@click.option("--ranks", callback=_ranks, metavar="LIST", help="Only these ranks, e.g. 0,2,4-7.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def perfetto(run_dir: Path, out: str | None, steps: Any, ranks: frozenset[int] | None, session_id: str | None) -> None:
    """Write the run as a Perfetto / Chrome trace: a process per rank, a track per thread, every
    span with its attrs, memory counters, marks, markers, alerts and verdicts. Open it in
    https://ui.perfetto.dev or chrome://tracing."""
    from ..exports.perfetto import TraceSelection, write_trace, write_trace_file
    from ..views.sources import run_json_of
    from .commands_verdicts import open_run_history

    with open_run_history(run_dir, session_id) as (store, chosen, _source):
        folder = run_dir if run_dir.is_dir() else run_dir.parent
        run = run_json_of(folder, chosen)
        hosts = [h for h in run.get("hosts") or [] if isinstance(h, str)]
        other = {k: run[k] for k in ("command_line", "world_size", "versions", "status") if k in run}
        selection = TraceSelection(chosen, steps, ranks)
        if out == "-":
            stats = write_trace(store, selection, sys.stdout.buffer, hosts=hosts, other=other)
            sys.stdout.buffer.flush()
            target = None
        else:
            target = Path(out) if out else folder / "trace.json"
            stats = write_trace_file(store, selection, target, hosts=hosts, other=other)
    counts = ", ".join(f"{n} {_PHASE_WORDS.get(ph, ph)}" for ph, n in sorted(stats.events.items()))
    where = "standard output" if target is None else str(target.resolve())
    size = "" if target is None else f", {target.stat().st_size / 2**20:.1f} MiB"
    _console(stderr=True).print(
        f"[stepwatch] trace: {where} (ranks {','.join(map(str, stats.ranks)) or 'none'}: {counts or 'no events'}"
        f"{size}); open it in https://ui.perfetto.dev", markup=False, soft_wrap=_soft_wrap(stderr=True))
    if target is not None:
        sys.stdout.write(f"{target}\n")


_PHASE_WORDS = {"X": "spans", "C": "counter values", "i": "instants", "M": "names"}


def _history_of(run_dir: Path, session_id: str | None) -> Any:
    """(points, params, summary, folder, session id) of the run's session: what every tracker
    export writes, read once from the history (read-only)."""
    from ..analysis.summary import build_summary
    from ..exports.tracker_data import tracker_params, tracker_points
    from ..views.sources import run_json_of
    from .commands_verdicts import open_run_history

    with open_run_history(run_dir, session_id) as (store, chosen, _source):
        folder = run_dir if run_dir.is_dir() else run_dir.parent
        run = run_json_of(folder, chosen)
        points = tracker_points(store, chosen)
        params = tracker_params(store, chosen, run)
        summary = build_summary(store, chosen, folder if (folder / "run.json").is_file() else None)
    return points, params, summary, folder, chosen


def _say(line: str) -> None:
    _console(stderr=True).print(f"[stepwatch] {line}", markup=False, soft_wrap=_soft_wrap(stderr=True))


@export.command("tensorboard")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Where to write the event files (default: RUN_DIR/tensorboard): DIR/rank_N per rank, DIR/summary.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def tensorboard(run_dir: Path, out: Path | None, session_id: str | None) -> None:
    """Write the run as TensorBoard event files: per rank and step, the step time, phase shares,
    steps/s, memory and the numeric marks (the loss); `tensorboard --logdir DIR` shows them."""
    export_tensorboard(run_dir, out, session_id)


def export_tensorboard(run_dir: Path, out: Path | None, session_id: str | None) -> Path:
    from ..exports.tensorboard import write_tensorboard
    from ..exports.tracker_data import summary_metrics

    points, params, summary, folder, _chosen = _history_of(run_dir, session_id)
    target = out if out is not None else folder / "tensorboard"
    stats = write_tensorboard(points, target, final=summary_metrics(summary), text=params)
    ranks = sorted({p.rank for p in points})
    _say(f"tensorboard: {target.resolve()} ({len(points)} steps of ranks {','.join(map(str, ranks)) or 'none'}, "
         f"{stats.scalars} scalars); tensorboard --logdir {target}")
    sys.stdout.write(f"{target}\n")
    return target
