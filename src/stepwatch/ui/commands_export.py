"""``stepwatch export``: a run's history in another tool's format. ``export perfetto`` writes the
Trace Event Format JSON that ui.perfetto.dev and ``chrome://tracing`` open; ``export
tensorboard``, ``export mlflow`` and ``export wandb`` feed the experiment trackers, and
``export_after_run`` does those for ``run --export`` (docs/export.md).

Exit codes: 0 written; 2 the input cannot be read, the selection matches nothing, a tracker's
package is missing or its export failed, or the command line is wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .base import StoreTarget, _console, _reports_errors, _soft_wrap

__all__ = ["TRACKERS", "export", "export_after_run"]


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
@click.argument("run_dir", type=StoreTarget())
@click.option("-o", "--out", default=None, metavar="FILE",
              help="Where to write the trace (default: RUN_DIR/trace.json, ./trace.json for a store URL; - for "
                   "standard output; a name ending .gz: gzip-compressed).")
@click.option("--steps", callback=_steps, metavar="A:B",
              help="Only steps A to B-1 (A:, :B and N too), on each rank from its step A's start to its step B-1's end.")
@click.option("--ranks", callback=_ranks, metavar="LIST", help="Only these ranks, e.g. 0,2,4-7.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def perfetto(run_dir: Path | str, out: str | None, steps: Any, ranks: frozenset[int] | None,
             session_id: str | None) -> None:
    """Write the run as a Perfetto / Chrome trace: a process per rank, a track per thread, every
    span with its attrs, memory counters, marks, markers, alerts and verdicts. Open it in
    https://ui.perfetto.dev or chrome://tracing. RUN_DIR may be a history store or a
    clickhouse:// URL (docs/clickhouse.md)."""
    from ..exports.perfetto import TraceSelection, write_trace, write_trace_file
    from ..views.sources import run_json_of
    from .commands_verdicts import open_run_history

    with open_run_history(run_dir, session_id) as (store, chosen, _source):
        if isinstance(run_dir, str):  # a store URL: no run directory; what run.json says, from the session
            folder, run = Path.cwd(), _session_run(store, chosen)
        else:
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


def _session_run(store: Any, session_id: str) -> dict[str, Any]:
    """The run.json fields a trace names (command line, world size, status), from the session's
    row: what a store URL has of them (no run directory, so no versions)."""
    import json

    rows = store.query("SELECT command_line, world_size, status FROM sessions WHERE session_id = ?", (session_id,))
    if not rows:
        return {}
    row = rows[0]
    try:
        command_line = json.loads(row["command_line"]) if row["command_line"] else None
    except ValueError:
        command_line = None
    found = {"command_line": command_line, "world_size": row["world_size"], "status": row["status"]}
    return {k: v for k, v in found.items() if v is not None}


_PHASE_WORDS = {"X": "spans", "C": "counter values", "i": "instants", "M": "names"}


def _shown(run_dir: Path | str) -> str:
    """What a tag names the run by: its folder, or the store URL without its password."""
    if isinstance(run_dir, str):
        from ..store.clickhouse_url import parse_clickhouse_url

        return str(parse_clickhouse_url(run_dir))
    return str((run_dir if run_dir.is_dir() else run_dir.parent).resolve())


def _history_of(run_dir: Path | str, session_id: str | None, artifacts: Path | None = None) -> Any:
    """(points, params, summary, folder, session id, artifact paths) of the run's session: what
    every tracker export writes, read once from the history (read-only). With ``artifacts``, a
    folder to write them in: the summary (JSON and text), the diagnosis, report.html and
    trace.json; one that cannot be made is left out with a line saying why. ``run_dir`` may be a
    store URL: then what run.json says comes from the session's row, and ``folder`` (where the
    exports go by default) is the current directory."""
    from ..analysis.summary import build_summary
    from ..exports.tracker_data import tracker_params, tracker_points
    from ..views.sources import run_json_of
    from .commands_verdicts import open_run_history

    with open_run_history(run_dir, session_id) as (store, chosen, _source):
        if isinstance(run_dir, str):  # a store URL: no run directory
            folder, run, own = Path.cwd(), _session_run(store, chosen), None
        else:
            folder = run_dir if run_dir.is_dir() else run_dir.parent
            run = run_json_of(folder, chosen)
            own = folder if (folder / "run.json").is_file() else None
        points = tracker_points(store, chosen)
        params = tracker_params(store, chosen, run)
        summary = build_summary(store, chosen, own)
        if "outcome" in run and not summary.get("outcome"):
            summary["outcome"] = run["outcome"]
        paths = (_write_artifacts(store, chosen, run_dir if isinstance(run_dir, str) else folder, run, summary,
                                  artifacts) if artifacts is not None else [])
    return points, params, summary, folder, chosen, paths


def _write_artifacts(store: Any, session_id: str, folder: Path | str, run: dict[str, Any], summary: dict[str, Any],
                     out: Path) -> list[Path]:
    import json

    from ..analysis.summary import render_summary_text
    from ..errors import StepwatchError
    from ..exports.perfetto import TraceSelection, write_trace_file
    from ..web.report import write_report

    written: list[Path] = []

    def attempt(name: str, make: Any) -> None:
        target = out / name
        try:
            make(target)
        except (StepwatchError, OSError, ValueError) as exc:
            _say(f"{name} left out: {exc}")
            return
        written.append(target)

    attempt("summary.json", lambda t: t.write_text(json.dumps(summary, indent=2, default=str)))
    attempt("summary.txt", lambda t: t.write_text(render_summary_text(summary)))
    attempt("diagnosis.json", lambda t: t.write_text(json.dumps(summary.get("diagnosis"), indent=2, default=str)))
    attempt("report.html", lambda t: write_report(folder, t, session_id))
    hosts = [h for h in run.get("hosts") or [] if isinstance(h, str)]
    other = {k: run[k] for k in ("command_line", "world_size", "versions", "status") if k in run}
    attempt("trace.json", lambda t: write_trace_file(store, TraceSelection(session_id, None, None), t,
                                                     hosts=hosts, other=other))
    return written


def _say(line: str) -> None:
    _console(stderr=True).print(f"[stepwatch] {line}", markup=False, soft_wrap=_soft_wrap(stderr=True))


@export.command("tensorboard")
@click.argument("run_dir", type=StoreTarget())
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Where to write the event files (default: RUN_DIR/tensorboard, ./tensorboard for a store URL): "
                   "DIR/rank_N per rank, DIR/summary.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def tensorboard(run_dir: Path | str, out: Path | None, session_id: str | None) -> None:
    """Write the run as TensorBoard event files: per rank and step, the step time, phase shares,
    steps/s, memory and the numeric marks (the loss); `tensorboard --logdir DIR` shows them."""
    target = export_tensorboard(run_dir, out, session_id)
    sys.stdout.write(f"{target}\n")


def export_tensorboard(run_dir: Path | str, out: Path | None, session_id: str | None) -> Path:
    from ..exports.tensorboard import write_tensorboard
    from ..exports.tracker_data import summary_metrics
    from ..exports.trackers import require, tracker_errors

    require("tensorboard", "tensorboard")  # before the history is read
    points, params, summary, folder, chosen, _paths = _history_of(run_dir, session_id)
    target = out if out is not None else folder / "tensorboard"
    with tracker_errors("tensorboard"):
        stats = write_tensorboard(points, target, final=summary_metrics(summary), text=params, session_id=chosen)
    ranks = sorted({p.rank for p in points})
    _say(f"tensorboard: {target.resolve()} ({len(points)} steps of ranks {','.join(map(str, ranks)) or 'none'}, "
         f"{stats.scalars} scalars); tensorboard --logdir {target}")
    return target


@export.command("mlflow")
@click.argument("run_dir", type=StoreTarget())
@click.option("--tracking-uri", default=None, metavar="URI", envvar="MLFLOW_TRACKING_URI",
              help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db, ./mlflow.db for a store URL; "
                   "a server: http://HOST:5000).")
@click.option("--experiment", default="stepwatch", show_default=True, help="Experiment name (made if missing).")
@click.option("--per-rank", is_flag=True, help="One MLflow run per rank instead of one per session.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def mlflow(run_dir: Path | str, tracking_uri: str | None, experiment: str, per_rank: bool, session_id: str | None) -> None:
    """Log the run to MLflow: params (command, world size, versions, loader and optimizer
    settings), a metric point per rank per step, the summary's figures, and the summary,
    diagnosis, report.html and trace.json as artifacts."""
    for run_id in export_mlflow_run(run_dir, tracking_uri, experiment, per_rank, session_id):
        sys.stdout.write(f"{run_id}\n")


def export_mlflow_run(run_dir: Path | str, tracking_uri: str | None, experiment: str, per_rank: bool,
                      session_id: str | None) -> list[str]:
    import os
    import tempfile

    from ..exports.mlflow_export import export_mlflow, mlflow_status
    from ..exports.tracker_data import summary_metrics
    from ..exports.trackers import require, tracker_errors

    require("mlflow", "mlflow")  # before the artifacts are made
    # a tracking server that does not answer costs seconds, not MLflow's default of 7 retries
    # with backoff (4 minutes measured); the user's own settings win
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    with tempfile.TemporaryDirectory(prefix="stepwatch-mlflow-") as tmp:
        points, params, summary, folder, chosen, paths = _history_of(run_dir, session_id, Path(tmp))
        uri = tracking_uri or f"sqlite:///{(folder / 'mlflow.db').resolve()}"
        primary = (summary.get("diagnosis") or {}).get("primary") or {}
        tags = {"stepwatch.session_id": chosen, "stepwatch.run_dir": _shown(run_dir),
                **({"stepwatch.verdict": str(primary["name"])} if primary.get("name") else {}),
                **({"stepwatch.outcome": str(summary["outcome"])} if summary.get("outcome") else {})}
        text = next((p for p in paths if p.name == "summary.txt"), None)
        if text is not None:  # the run's description in MLflow's UI
            tags["mlflow.note.content"] = text.read_text()[:5000]
        started, ended = summary.get("started_at_ns"), summary.get("ended_at_ns")
        with tracker_errors("mlflow"):
            done = export_mlflow(points, params, summary_metrics(summary), tags, paths, tracking_uri=uri,
                                 experiment=experiment, per_rank=per_rank, run_name=f"stepwatch {chosen[:8]}",
                                 start_ms=started // 1_000_000 if isinstance(started, int) else None,
                                 end_ms=ended // 1_000_000 if isinstance(ended, int) else None,
                                 status=mlflow_status(summary.get("outcome")))
    runs = ", ".join(f"{group} {run_id}" + (" (exported before: kept)" if group in done.kept else
                                           " (replaces the earlier export)" if group in done.replaced else "")
                     for group, run_id in done.run_ids.items())
    _say(f"mlflow: {uri} experiment {experiment!r} (id {done.experiment_id}): {runs}; {done.metric_points} metric "
         f"points, {len(paths)} artifacts")
    return list(done.run_ids.values())


@export.command("wandb")
@click.argument("run_dir", type=StoreTarget())
@click.option("--dir", "out", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Where W&B writes (default: RUN_DIR, . for a store URL): DIR/wandb/offline-run-<time>-<id>.")
@click.option("--project", default="stepwatch", show_default=True, help="The W&B project `wandb sync` uploads to.")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def wandb(run_dir: Path | str, out: Path | None, project: str, session_id: str | None) -> None:
    """Write the run as a W&B offline run (no login, no network): config from the params, a
    history row per step with every rank's scalars, the summary, and the summary, diagnosis,
    report.html and trace.json as files. `wandb sync DIR` uploads it later."""
    sys.stdout.write(f"{export_wandb_run(run_dir, out, project, session_id)}\n")


def export_wandb_run(run_dir: Path | str, out: Path | None, project: str, session_id: str | None) -> Path:
    import tempfile

    from ..exports.tracker_data import summary_metrics
    from ..exports.trackers import require, tracker_errors
    from ..exports.wandb_export import export_wandb

    require("wandb", "wandb")
    with tempfile.TemporaryDirectory(prefix="stepwatch-wandb-") as tmp:
        points, params, summary, folder, chosen, paths = _history_of(run_dir, session_id, Path(tmp))
        primary = (summary.get("diagnosis") or {}).get("primary") or {}
        tags = ["stepwatch", *([str(primary["name"])] if primary.get("name") else []),
                *([str(summary["outcome"])] if summary.get("outcome") else [])]
        final = {**summary_metrics(summary), **({"verdict": str(primary["name"])} if primary.get("name") else {})}
        failed = summary.get("outcome") not in (None, "succeeded", "exited")
        with tracker_errors("wandb"):
            done = export_wandb(points, params, final, tags, paths, out=out or folder, project=project,
                                name=f"stepwatch {chosen[:8]}", session_id=chosen, exit_code=1 if failed else 0)
    again = ", in place of the earlier export" if done.replaced else ""
    _say(f"wandb: {done.run_dir.resolve()} (offline run {done.run_id}: {done.rows} steps, {len(paths)} files{again}); "
         f"upload it with: wandb sync {done.run_dir}")
    return done.run_dir


TRACKERS = ("mlflow", "tensorboard", "wandb")


def export_after_run(run_dir: Path, session_id: str | None, trackers: tuple[str, ...]) -> None:
    """``run --export``: each tracker's export with its defaults (MLflow: $MLFLOW_TRACKING_URI,
    else sqlite:///RUN_DIR/mlflow.db; TensorBoard: RUN_DIR/tensorboard; W&B: RUN_DIR/wandb). A
    failure is one line naming the tracker, never the run's exit code: the training is done, and
    ``stepwatch export`` can do it again later."""
    import os

    for tracker in dict.fromkeys(trackers):
        try:
            if tracker == "mlflow":
                export_mlflow_run(run_dir, os.environ.get("MLFLOW_TRACKING_URI") or None, "stepwatch", False,
                                  session_id)
            elif tracker == "tensorboard":
                export_tensorboard(run_dir, None, session_id)
            else:
                export_wandb_run(run_dir, None, "stepwatch", session_id)
        except Exception as exc:  # noqa: BLE001 (a tracker's own errors too: the run's result stands)
            text = " ".join(str(exc).split()) or type(exc).__name__
            _say(f"export {tracker} failed: {text}")
