"""Reading commands of the CLI: ``validate``, ``sessions``, ``inspect``.

Every reading command takes a run directory or any single artifact in it, prints with rich,
and prints JSON instead with ``--json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from .base import EXIT_INVALID, _console, _print_json, _reports_errors, json_option, legacy_option

__all__ = ["inspect", "sessions", "validate"]


@click.command()
@click.argument("path", type=click.Path())
@legacy_option
@json_option
@_reports_errors
def validate(path: str, strict: bool, as_json: bool) -> None:
    """Check every telemetry record under PATH; list each invalid one with file, line and reason."""
    from ..artifacts.record_check import check_artifact
    from ..errors import ArtifactError

    report = check_artifact(path, permissive_legacy=not strict)
    if report.files == 0:
        # Nothing there to check (no such path, no telemetry in it): unreadable, not invalid.
        raise ArtifactError(path, report.problems[0].reason if report.problems else "no telemetry artifacts found")
    failed = bool(report.errors)
    if as_json:
        _print_json({**msgspec.to_builtins(report), "ok": not failed})
    else:
        from rich.table import Table

        console = _console()
        if report.problems:
            table = Table(title="Problems", title_justify="left")
            for column in ("severity", "file", "line", "field", "reason"):
                table.add_column(column, overflow="fold")
            for p in report.problems:
                where = str(p.line) if p.line is not None else (f"[{p.index}]" if p.index is not None else "")
                style = "red" if p.severity == "error" else "yellow"
                table.add_row(f"[{style}]{p.severity}[/]", p.file, where, p.field or "", p.reason)
            console.print(table)
        verdict = "[red]INVALID[/]" if failed else "[green]OK[/]"
        console.print(
            f"{verdict}  {report.records} records in {report.files} files: "
            f"{report.valid} valid, {len(report.errors)} invalid"
        )
    sys.exit(EXIT_INVALID if failed else 0)


@click.command()
@click.argument("path", type=click.Path())
@json_option
@_reports_errors
def sessions(path: str, as_json: bool) -> None:
    """List the capture sessions under PATH with status, ranks and event counts."""
    from ..artifacts.telemetry_loader import load_telemetry_sessions
    from .format import fmt_duration, fmt_ns

    loaded = load_telemetry_sessions(path)
    if as_json:
        _print_json(
            [
                {**msgspec.to_builtins(s.summary), "default": i == 0, "skipped_records": s.skipped_records,
                 "torn_lines": s.torn_lines, "missing_segments": s.missing_segments,
                 "empty_segments": s.empty_segments, "unreadable_manifests": s.unreadable_manifests,
                 "warnings": s.warnings}
                for i, s in enumerate(loaded)
            ]
        )
        return
    from rich.table import Table

    console = _console()
    colours = {"completed": "green", "interrupted": "yellow", "incomplete": "red", "running": "cyan"}
    rows = []
    for i, s in enumerate(loaded):
        m = s.summary
        span = (m.last_timestamp_ns - m.first_timestamp_ns) / 1e9 if m.first_timestamp_ns and m.last_timestamp_ns else None
        rows.append(("*" if i == 0 else "", m.session_id, f"[{colours.get(m.status, 'white')}]{m.status}[/]",
                     ",".join(map(str, m.ranks)) or "-", str(m.event_count), fmt_ns(m.first_timestamp_ns),
                     fmt_duration(span), m.host, m.source))
    table = Table(title=f"Sessions in {path}", title_justify="left")
    for column in ("", "session", "status", "ranks", "events", "first", "duration", "host", "source"):
        table.add_column(column, no_wrap=column in ("session", "status", "first"))
    for row in rows:
        table.add_row(*row)
    if console.measure(table, options=console.options.update_width(10_000)).maximum > console.width:
        # A narrow terminal (80 columns): one column of facts beside the session id, so nothing
        # is cut and the id stays whole (people copy it into --session).
        table = Table(title=f"Sessions in {path}", title_justify="left")
        table.add_column("")
        table.add_column("session", no_wrap=True)
        table.add_column("ranks, events, first, duration, host, source", overflow="fold")
        for mark, sid, status, ranks, events, first, duration, host, source in rows:
            table.add_row(mark, f"{sid}\n{status}",
                          f"ranks {ranks}, {events} events\nfirst {first}\n{duration}, host {host}\n{source}")
    console.print(table)
    console.print("* default session: newest completed, then interrupted, then incomplete")
    for s in loaded:
        for warning in s.warnings:
            console.print(f"[yellow]warning:[/] {s.summary.session_id[:8]}: {warning}")


@click.command()
@click.argument("path", type=click.Path())
@click.option("--session", "session_id", help="Session id (default: the default selection).")
@json_option
@_reports_errors
def inspect(path: str, session_id: str | None, as_json: bool) -> None:
    """Summarise one session: time span, collectors, event types, peak memory per device."""
    from ..analysis.session_report import report_session
    from ..artifacts.telemetry_loader import load_telemetry_sessions
    from ..errors import ArtifactError
    from ..schema import select_default_session
    from .format import fmt_bytes, fmt_duration, fmt_ns

    loaded = load_telemetry_sessions(path)
    if session_id is not None:
        chosen = next((s for s in loaded if s.summary.session_id == session_id), None)
        if chosen is None:
            raise ArtifactError(path, f"session {session_id} not found")
    else:
        chosen = select_default_session([s for s in loaded if s.events] or loaded)
        if chosen is None:
            raise ArtifactError(path, "no sessions found")
    report = report_session(chosen)
    epochs = _inspect_epochs(Path(path), report.session_id)
    if as_json:
        _print_json({**msgspec.to_builtins(report), "epochs": epochs})
        return
    from rich.table import Table

    console = _console()
    console.print(f"[bold]Session[/] {report.session_id}  [bold]{report.status}[/]  host {report.host}")
    console.print(
        f"  {fmt_ns(report.first_timestamp_ns)} -> {fmt_ns(report.last_timestamp_ns)}"
        f"  ({fmt_duration(report.duration_s)}), {report.event_count} events,"
        f" ranks {','.join(map(str, report.ranks)) or '-'} of {report.world_size}"
    )
    if report.skipped_records or report.torn_lines:
        console.print(
            f"  [yellow]skipped {report.skipped_records} unconvertible records, "
            f"{report.torn_lines} torn lines[/]"
        )
    for warning in report.warnings:
        console.print(f"  [yellow]warning:[/] {warning}")
    counts = Table(title="Collectors and event types", title_justify="left")
    counts.add_column("kind")
    counts.add_column("name")
    counts.add_column("events", justify="right")
    for name, n in report.collectors.items():
        counts.add_row("collector", name, str(n))
    for name, n in report.event_types.items():
        counts.add_row("event type", name, str(n))
    console.print(counts)
    peaks = Table(title="Peak memory per device", title_justify="left")
    for column in ("rank", "device", "collector", "peak allocated", "at", "peak reserved", "total"):
        peaks.add_column(column, justify="right" if column.startswith("peak") else "left")
    for p in report.peaks:
        peaks.add_row(
            str(p.rank), "cpu" if p.device_id < 0 else str(p.device_id), p.collector,
            fmt_bytes(p.peak_allocated_bytes), fmt_ns(p.peak_allocated_at_ns),
            fmt_bytes(p.peak_reserved_bytes), fmt_bytes(p.device_total_bytes),
        )
    console.print(peaks)
    from ..analysis.epochs import render_epoch_line

    console.print(render_epoch_line(epochs) or "no epochs recorded", markup=False)


def _inspect_epochs(path: Path, session_id: str) -> dict[str, Any] | None:
    """The session's epochs from the run directory holding ``path``: its history when it has
    one, else its spool (when run.json names this session). None where neither is there."""
    from .._decode import read_json_file
    from ..analysis.epochs import epoch_report
    from ..errors import StepwatchError

    run_dir = next((d for d in (path, *path.parents)[:4] if (d / "run.json").is_file() or (d / "spool").is_dir()), None)
    if run_dir is None:
        return None
    if (run_dir / "history.sqlite").is_file():
        from ..analysis.summary import session_epochs
        from ..store.sqlite import SqliteStore

        try:
            with SqliteStore(run_dir / "history.sqlite", read_only=True) as store:
                found = session_epochs(store, session_id)
            if found is not None:
                return found
        except StepwatchError:
            pass
    try:
        if read_json_file(run_dir / "run.json").get("session_id") != session_id:
            return None
        from ..artifacts.spool import read_spool

        return epoch_report(read_spool(run_dir / "spool").spans)
    except (OSError, ValueError, AttributeError, StepwatchError):
        return None
