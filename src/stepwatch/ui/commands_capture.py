"""Capture commands of the CLI: ``track`` and ``diagnose``."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import click

from .base import _console, _print_json, _reports_errors

__all__ = ["diagnose", "track"]


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--interval", "interval_ms", type=click.IntRange(10, 3_600_000), default=1000, show_default=True,
              help="Sampling interval in milliseconds.")
@click.option("--out", type=click.Path(path_type=Path), help="Run directory (default ./stepwatch_runs/<time>-<id>).")
@click.option("--pid", type=int, help="Sample an existing process from outside instead of running a command.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_reports_errors
def track(interval_ms: int, out: Path | None, pid: int | None, command: tuple[str, ...]) -> None:
    """Capture COMMAND (after --), or --pid PID, into a run directory, always on.

    A Python COMMAND is captured in-process with no code change; other programs, and --pid,
    are sampled from outside (RSS, and per-process GPU memory through NVML when present).
    """
    from ..capture.track import default_run_dir, sample_process, track_command
    from ..schema import new_session_id

    console = _console(stderr=True)
    if pid is not None:
        if command:
            raise click.UsageError("give either --pid or a command, not both")
        import psutil

        if not psutil.pid_exists(pid):
            raise click.BadParameter(f"no process with pid {pid}", param_hint="'--pid'")
        session_id = new_session_id()
        run_dir = out or default_run_dir(session_id)
        console.print(f"[stepwatch] sampling pid {pid} into {run_dir} (Ctrl-C to stop)", markup=False)
        status = sample_process(pid, run_dir=run_dir, interval_ms=interval_ms, session_id=session_id)
        console.print(f"[stepwatch] session {status}; run directory: {run_dir}", markup=False)
        return
    if not command:
        raise click.UsageError("nothing to run: stepwatch track [OPTIONS] -- COMMAND [ARGS]...")
    try:
        code, run_dir, status = track_command(list(command), out=out, interval_ms=interval_ms)
    except FileNotFoundError as exc:
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        # a missing script is a usage error (as python says it: 2); a missing program, 127
        sys.exit(2 if "no such script" in str(exc) else 127)
    console.print(f"[stepwatch] exit code {code}, session {status}; run directory: {run_dir}", markup=False)
    console.print(f"[stepwatch] next: stepwatch inspect {run_dir}", markup=False)
    sys.exit(code)


@click.command()
@click.argument("path", type=click.Path(path_type=Path), required=False)
@click.option("--output", type=click.Path(path_type=Path), help="Bundle directory (default ./stepwatch_diagnose_<time>).")
@click.option("--duration", type=click.FloatRange(0.1, 600), default=1.0, show_default=True,
              help="Seconds of live sampling when no PATH is given.")
@click.option("--fail-on-risk", is_flag=True, help="Exit with code 1 when a risk is detected.")
@click.option("--json", "as_json", is_flag=True, help="Print the bundle manifest as JSON.")
@_reports_errors
def diagnose(path: Path | None, output: Path | None, duration: float, fail_on_risk: bool, as_json: bool) -> None:
    """Write a standalone diagnose bundle: environment, device inventory, a short timeline, risks.

    With PATH (a run directory or any telemetry artifact) the bundle describes its default
    session; without, it samples this machine for --duration seconds.
    """
    from ..analysis.bundle_risks import assess_risks, sample_timeline, timeline_from_events
    from ..artifacts.bundles import write_diagnose_bundle
    from ..artifacts.telemetry_loader import load_telemetry_sessions
    from ..schema import SessionSummary, new_session_id, select_default_session

    output = output or Path(f"stepwatch_diagnose_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    if path is not None:
        loaded = load_telemetry_sessions(path)
        chosen = select_default_session([s for s in loaded if s.events] or loaded)
        if chosen is None:
            raise click.UsageError(f"no sessions in {path}")
        session, events = chosen.summary, chosen.events
        timeline = timeline_from_events(events)
    else:
        started = time.time_ns()
        timeline = sample_timeline(duration)
        session = SessionSummary(session_id=new_session_id(), status="completed", started_at_ns=started,
                                 ended_at_ns=time.time_ns(), source="stepwatch.diagnose",
                                 host=socket.gethostname(), pid=os.getpid())
        events = []
    risks = assess_risks(events, timeline)
    exit_code = 1 if (fail_on_risk and risks) else 0
    summary = {"risks": risks, "event_count": len(events), "timeline_points": len(timeline["timestamps"]),
               "source_path": str(path) if path else None}
    bundle = write_diagnose_bundle(output, session=session, timeline=timeline, summary=summary,
                                   command_line=list(sys.argv), exit_code=exit_code)
    if as_json:
        from ..artifacts.bundles import read_bundle_manifest

        _print_json(read_bundle_manifest(bundle))
    else:
        console = _console()
        console.print(f"diagnose bundle: {bundle}  (session {session.session_id}, {session.status})")
        for risk in risks:
            console.print(f"  [yellow]risk[/] {risk['name']}: {risk.get('detail') or risk}")
        if not risks:
            console.print("  no risk detected")
    sys.exit(exit_code)
