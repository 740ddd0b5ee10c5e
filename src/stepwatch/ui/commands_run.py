"""History commands of the CLI: ``run``, ``serve``, ``summary``, ``compare``, ``import``."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from .base import StoreTarget, _console, _fit_text, _print_json, _reports_errors, _soft_wrap
from .commands_export import TRACKERS
from .commands_verdicts import load_cli_policy, policy_options
from .commands_watch import watchdog_options
from .feed_options import check_binds, feed_options, read_token, token_env_option

__all__ = ["compare", "import_command", "run", "serve", "summary"]


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc-per-node", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Ranks on this node (through torchrun when > 1).")
@click.option("--nnodes", type=click.IntRange(1, 100_000), default=1, show_default=True)
@click.option("--node-rank", type=click.IntRange(0), default=0, show_default=True)
@click.option("--master-addr", default="127.0.0.1", show_default=True)
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="torchrun's rendezvous port. Default: $MASTER_PORT, else a free port on one node "
                   "(two jobs can share a machine), 29500 across nodes.")
@click.option("--torchrun", "use_torchrun", is_flag=True, help="Use torchrun even for one rank.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Aggregator bind address (0.0.0.0 for multi-node).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="Aggregator TCP port (0: any free).")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None, help="Also serve trace ingestion over HTTP.")
@click.option("--aggregator", help="Use a running aggregator at HOST:PORT (other nodes of a multi-node run).")
@click.option("--session-id", help="Session id (give the same one on every node).")
@click.option("--out", type=click.Path(path_type=Path), help="Run directory.")
@click.option("--interval", "interval_ms", type=click.IntRange(10, 3_600_000), default=1000, show_default=True,
              help="Memory sampling interval in milliseconds.")
@click.option("--retention", default=None, metavar="DURATION",
              help="Keep only this much history per session and rank, e.g. 7d, 12h (default: all).")
@click.option("--store", "store", type=StoreTarget(), default=None, metavar="URL",
              help="Write the history to this store instead of the run directory's history.sqlite: "
                   "clickhouse://user@host:9000/db (docs/clickhouse.md).")
@watchdog_options
@click.option("--on-stall", type=click.Choice(["dump", "kill"]), default="dump", show_default=True,
              help="On STALL: dump every rank's stacks; kill: dump, then end the job (exit code 124).")
@click.option("--on-nonfinite", type=click.Choice(["alert", "halt"]), default="alert", show_default=True,
              help="On NONFINITE: alert only, or halt every rank at the same step.")
@click.option("--quiet", is_flag=True, help="Do not print the summary.")
@click.option("--view", "view_mode", type=click.Choice(["auto", "live", "plain", "off"]), default="auto",
              show_default=True,
              help="While it trains: live, the terminal view (ranks, progress, verdict, alerts); plain, one line "
                   "every 10 s; auto: live on a terminal, else plain (docs/live-view.md).")
@click.option("--view-every", "view_every", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="The view's period (default: 1 s live, 10 s plain).")
@click.option("--ui-port", type=click.IntRange(0, 65535), default=None,
              help="Serve the dashboard on this port while the run trains (0: any free; docs/dashboard.md).")
@click.option("--ui-host", metavar="ADDRESS", default=None,
              help="The address the dashboard binds (default: --host when that is loopback or a token is set, else "
                   "127.0.0.1); anything but loopback needs --token-env.")
@token_env_option
@click.option("--report", "write_html", is_flag=True, help="Write RUN_DIR/report.html (one self-contained file) at the end.")
@click.option("--export", "exports", multiple=True, type=click.Choice(TRACKERS),
              help="At the end, export the run to this tracker (repeatable; defaults as `stepwatch export`, "
                   "docs/export.md). A failed export is one line and leaves the exit code alone.")
@feed_options
@click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
@_reports_errors
def run(script: tuple[str, ...], quiet: bool, retention: str | None, view_mode: str, view_every: float | None,
        write_html: bool, exports: tuple[str, ...], **options: Any) -> None:
    """Run SCRIPT [ARGS]... on every rank under stepwatch, with the aggregator and final summary.

    The training script needs no change. Exits with the training's exit code, or 124 when
    --on-stall kill ended a stalled job.
    """
    from ..server.launcher import LaunchOptions, launch
    from ..server.settings import RETENTION_ENV, parse_duration

    if retention:  # the options' values first, then the script: nothing is started on either error
        try:
            parse_duration(retention)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--retention") from None
    if options.get("aggregator") and any(options.get(o) is not None for o in ("metrics_port", "alert_webhook",
                                                                              "otlp_endpoint")):
        raise click.UsageError("--metrics-port, --alert-webhook and --otlp-endpoint are the aggregator's feeds, and "
                               "with --aggregator there is none here: give them where the aggregator runs")
    if options.get("aggregator") and options.get("ui_port") is not None:
        raise click.UsageError("--ui-port serves the dashboard from this node's aggregator, and with --aggregator "
                               "there is none here: run it where the history is (or stepwatch ui there)")
    store = options.get("store")
    if store is not None and not isinstance(store, str):
        raise click.BadParameter("a store URL (clickhouse://host:9000/db); the default is the run directory's "
                                 "history.sqlite", param_hint="--store")
    check_binds(read_token(options.get("token_env")), metrics_host=(options.get("metrics_host"),
                                                                    options.get("metrics_port")),
                ui_host=(options.get("ui_host"), options.get("ui_port")))
    ctx = click.get_current_context()
    script = _without_interpreter(ctx, script)
    _check_script(ctx, script)
    if retention:
        os.environ[RETENTION_ENV] = retention  # the aggregator the launcher starts inherits it

    console = _console(stderr=True)
    view = _run_view(console, view_mode, view_every)
    soft = _soft_wrap(stderr=True)
    echo = view.print if view is not None else (lambda line: console.print(line, markup=False, soft_wrap=soft))
    code, run_dir, summary = launch(LaunchOptions(script=list(script), **options), echo=echo, view=view)
    if view is not None:
        view.finish()  # the plain line's last word: the final figures and the diagnosis's verdict
    if summary is not None and not quiet:
        from ..analysis.summary import render_summary_text

        sys.stdout.write(_fit_text(render_summary_text(summary)))  # from memory: a full disk may not hold the file
    session_id = options.get("session_id") or _run_session(run_dir)
    if write_html:
        _write_html_report(run_dir, session_id, console, store)
    if exports:
        from .commands_export import export_after_run

        export_after_run(run_dir, session_id, exports, store)
    console.print(f"[stepwatch] exit code {code}; run directory: {run_dir.resolve()}", markup=False)
    console.print(f"[stepwatch] look at: {run_dir}/final_summary.txt, stepwatch inspect {run_dir}", markup=False)
    sys.exit(code)


def _run_view(console: Any, mode: str, every_s: float | None) -> Any:
    """The view ``run`` shows while the job trains: the live view on a terminal (``auto``, not
    a dumb one), else the plain line; None for ``off``."""
    if mode == "off":
        return None
    from .live.run_view import RunView
    from .live.table import REFRESH_S
    from .live.text import PLAIN_EVERY_S

    live = mode == "live" or (mode == "auto" and console.is_terminal and not console.is_dumb_terminal)
    return RunView(console, live=live, refresh_s=every_s or REFRESH_S, plain_every_s=every_s or PLAIN_EVERY_S)


def _run_session(run_dir: Path) -> str | None:
    """The session ``run`` recorded (run.json), so what is made after it names this run's, not
    the newest session of a store other jobs write to as well."""
    try:
        session = json.loads((run_dir / "run.json").read_text()).get("session_id")
    except (OSError, ValueError, AttributeError):
        return None
    return session if isinstance(session, str) else None


def _write_html_report(run_dir: Path, session_id: str | None, console: Any, store: str | None = None) -> None:
    """``run --report``: the run's report.html (from ``store`` when the history went there); a
    failure is one line, never the run's exit code."""
    from ..errors import StepwatchError
    from ..web.report import write_report

    try:
        if store is None:
            target = write_report(run_dir, session_id=session_id)
        else:
            target = write_report(store, run_dir / "report.html", session_id)
    except (StepwatchError, OSError) as exc:
        console.print(f"[stepwatch] report not written: {exc}", markup=False, soft_wrap=_soft_wrap(stderr=True))
        return
    console.print(f"[stepwatch] report: {target.resolve()}", markup=False, soft_wrap=_soft_wrap(stderr=True))


_INTERPRETER = re.compile(r"python(\d+(\.\d+)?)?")


def _without_interpreter(ctx: click.Context, script: tuple[str, ...]) -> tuple[str, ...]:
    """``stepwatch run python train.py``, as one types after ``nohup`` or ``time``: ``run``
    starts the script (and torchrun) under the Python stepwatch is installed in, so naming that
    Python is allowed and dropped. Another interpreter is a usage error saying which one ``run``
    uses: its packages are not the ones the script would get."""
    first = script[0]
    if not _INTERPRETER.fullmatch(Path(first).name):
        return script
    found = shutil.which(first)
    ours = Path(sys.executable).absolute()
    if found is not None and Path(found).absolute().parent == ours.parent:
        if len(script) < 2:
            raise click.UsageError(f"{first} needs a script: stepwatch run train.py [ARGS]...", ctx=ctx)
        return script[1:]
    raise click.UsageError(f"stepwatch run starts the script under the Python stepwatch is installed in ({ours}), "
                           f"not {first}: give the script alone (stepwatch run train.py [ARGS]...), or run the "
                           f"stepwatch installed beside {first}", ctx=ctx)


# What may come before the script: python's ``-m MODULE`` (torchrun takes it too).
_SCRIPT_FLAGS = ("-m",)


def _check_script(ctx: click.Context, script: tuple[str, ...]) -> None:
    """An option ``run`` does not know, before the script, is a typo, not the script: a usage
    error naming the nearest option. A script that does not exist is one clear line. Both exit
    2 before any process or run directory exists."""
    first = script[0]
    if first.startswith("-") and first not in _SCRIPT_FLAGS:
        name = first.split("=", 1)[0]
        known = sorted({opt for param in ctx.command.params for opt in (*param.opts, *param.secondary_opts)
                        if opt.startswith("--")})
        raise click.NoSuchOption(name, possibilities=difflib.get_close_matches(name, known, n=3, cutoff=0.6),
                                 ctx=ctx)
    if first in _SCRIPT_FLAGS:
        if len(script) < 2:
            raise click.UsageError(f"{first} needs a module name", ctx=ctx)
        return
    if not Path(first).exists():
        from ..errors import ArtifactError

        raise ArtifactError(first, "no such script (nothing was started)")


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("stepwatch_server"), show_default=True,
              help="Directory of the history store (history.sqlite) and uploaded blobs.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="TCP port for rank frames (0: any free).")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None, help="HTTP port for trace ingestion.")
@click.option("--ui-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve the dashboard over --out on this port (0: any free; docs/dashboard.md).")
@click.option("--ui-host", metavar="ADDRESS", default=None,
              help="The address the dashboard binds (default: --host when that is loopback or a token is set, else "
                   "127.0.0.1); anything but loopback needs --token-env.")
@token_env_option
@click.option("--retention", default=None, metavar="DURATION",
              help="Keep only this much history per session and rank, e.g. 7d, 12h (default: all).")
@click.option("--session-id", help="Session of frames that name none (legacy senders).")
@click.option("--store", "store", type=StoreTarget(), default=None, metavar="URL",
              help="Write the history to this store instead of --out's history.sqlite: "
                   "clickhouse://user@host:9000/db (docs/clickhouse.md).")
@watchdog_options
@feed_options
@_reports_errors
def serve(out: Path, host: str, port: int, http_port: int | None, token_env: str | None, retention: str | None,
          session_id: str | None, stall_after: float, throughput_window: float, ui_port: int | None = None,
          metrics_port: int | None = None, alert_webhook: str | None = None, otlp_endpoint: str | None = None,
          store: Path | str | None = None, metrics_host: str | None = None, ui_host: str | None = None) -> None:
    """Run the aggregator alone: a standing ingestion server, or the hub of a multi-node run.

    Prints its addresses as one JSON line; Ctrl-C or SIGTERM drains and stops it.
    """
    from ..server.serve import serve as run_server
    from ..server.settings import parse_duration

    if store is not None and not isinstance(store, str):
        raise click.BadParameter("a store URL (clickhouse://host:9000/db); the default is --out's history.sqlite",
                                 param_hint="--store")
    retention_ns = None
    if retention:
        try:
            retention_ns = parse_duration(retention)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--retention") from None

    token = read_token(token_env)
    check_binds(token, metrics_host=(metrics_host, metrics_port), ui_host=(ui_host, ui_port))
    stats = run_server(out, host=host, port=port, http_port=http_port, token=token, session_id=session_id,
                       retention_ns=retention_ns, ui_port=ui_port, ui_host=ui_host, store=store,
                       feeds={"metrics_port": metrics_port, "metrics_host": metrics_host,
                              "alert_webhook": alert_webhook, "otlp_endpoint": otlp_endpoint},
                       watch={"stall_after_s": stall_after, "throughput_window_s": throughput_window})
    _console(stderr=True).print(f"[stepwatch] aggregator stopped: {stats}", markup=False)


def _summary_of(target: Path | str, session_id: str | None, policy: Any = None) -> dict[str, Any]:
    """The summary of a run directory, a history store or a final_summary.json; with a verdict
    ``policy`` it is recomputed (a written final_summary.json holds the default policy's)."""
    from ..analysis.summary import build_summary
    from ..store.sqlite import SqliteStore

    if isinstance(target, str):  # a store URL (clickhouse://...), read-only
        from ..store import open_store

        store = open_store(target, read_only=True)
        try:
            _require_session(store, target, session_id)
            return build_summary(store, session_id, None, policy=policy)
        finally:
            store.close()
    if target.is_file() and target.suffix == ".json":
        data = json.loads(target.read_text())
        if session_id is not None and isinstance(data, dict) and data.get("session_id") != session_id:
            _no_such_session(target, session_id, [{"session_id": data.get("session_id"), "status": data.get("status")}])
        return data
    if target.is_dir() and (target / "final_summary.json").is_file() and session_id is None and policy is None:
        return json.loads((target / "final_summary.json").read_text())
    store_path = target / "history.sqlite" if target.is_dir() else target
    if store_path.is_file():
        with SqliteStore(store_path, read_only=True) as store:
            _require_session(store, target, session_id)
            return build_summary(store, session_id, target if target.is_dir() else None, policy=policy)
    # no store: import the run directory's artifacts into a temporary one
    import tempfile

    from ..store.importers import import_path

    with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "history.sqlite") as store:
        import_path(target, store)
        _require_session(store, target, session_id)
        return build_summary(store, session_id, target if target.is_dir() else None, policy=policy)


def _require_session(store: Any, target: Path | str, session_id: str | None) -> None:
    """A session the store does not hold is an error naming the ones it does, never an empty
    summary."""
    if session_id is None:
        return
    sessions = store.sessions()
    if not any(s["session_id"] == session_id for s in sessions):
        _no_such_session(target, session_id, sessions)


def _no_such_session(target: Path | str, session_id: str, sessions: list[dict[str, Any]]) -> None:
    from ..errors import ArtifactError

    listed = ", ".join(f"{s['session_id']} ({s.get('status')})" for s in sessions) or "none"
    raise ArtifactError(target, f"no session {session_id!r} here; its sessions: {listed}")


def _write_summary_files(run_dir: Path, data: dict[str, Any]) -> None:
    """final_summary.json/.txt of a run directory without a history store (``track``)."""
    from ..analysis.summary import render_summary_text

    (run_dir / "final_summary.json").write_text(json.dumps(data, indent=2) + "\n")
    (run_dir / "final_summary.txt").write_text(render_summary_text(data))


@click.command()
@click.argument("target", type=StoreTarget(exists=True))
@click.option("--session", "session_id", help="Session id (default: the newest).")
@click.option("--write", is_flag=True, help="(Re)write final_summary.json/.txt into the run directory.")
@click.option("--json", "as_json", is_flag=True)
@policy_options
@_reports_errors
def summary(target: Path | str, session_id: str | None, write: bool, as_json: bool, policy_file: Path | None = None,
            overrides: tuple[str, ...] = ()) -> None:
    """Final summary of a run directory, a history store (a path or a clickhouse:// URL), or a
    final_summary.json.

    Its diagnosis comes first; --policy/--set recompute it with other thresholds."""
    from ..analysis.summary import render_summary_text
    from ..artifacts.run_manifest import run_session_id

    policy = load_cli_policy(policy_file, overrides)

    if write and (isinstance(target, str) or not target.is_dir()):
        raise click.UsageError("--write needs a run directory (it writes final_summary.* into it)")
    if write and (target / "history.sqlite").is_file():
        from ..server.launcher import write_final_summary
        from ..store.sqlite import SqliteStore

        with SqliteStore(target / "history.sqlite", read_only=True) as store:
            _require_session(store, target, session_id)
        data = write_final_summary(target, session_id, None, None, None, None, policy=policy)
    elif write:  # a run captured by ``track``: no history, the summary comes from its artifacts
        data = _summary_of(target, session_id if session_id is not None else run_session_id(target), policy)
        _write_summary_files(target, data)
    else:
        data = _summary_of(target, session_id, policy)
    if as_json:
        _print_json(data)
    else:
        sys.stdout.write(render_summary_text(data))


@click.command()
@click.argument("a", type=StoreTarget(exists=True))
@click.argument("b", type=StoreTarget(exists=True))
@click.option("--session-a", help="A's session, where A holds several (a store URL, a serve --out store).")
@click.option("--session-b", help="B's session, likewise.")
@click.option("--max-step-time-regression-pct", "max_regression_pct", type=click.FloatRange(0, min_open=False),
              default=None, metavar="PCT",
              help="Exit 4 when B's median step time is more than PCT percent above A's (for CI).")
@click.option("--json", "as_json", is_flag=True, help="Print {verdict, metrics} as JSON instead of the table.")
@_reports_errors
def compare(a: Path | str, b: Path | str, max_regression_pct: float | None, as_json: bool,
            session_a: str | None = None, session_b: str | None = None) -> None:
    """Differences of two runs' summaries (B relative to A), and a verdict: REGRESSION,
    IMPROVEMENT, MIXED, EQUIVALENT or INCONCLUSIVE (docs/compare.md).

    Exit codes: 0 compared (no regression past --max-step-time-regression-pct), 4 the step
    time rose past it, 3 inconclusive (too few steps, different workloads), 2 unreadable input.
    """
    from ..analysis.compare import compare_verdict
    from ..analysis.summary import compare_summaries

    if a == b and (session_a is None or session_b is None or session_a == session_b):
        raise click.UsageError("A and B are the same store: name two sessions with --session-a and --session-b")
    summary_a, summary_b = _summary_of(a, session_a), _summary_of(b, session_b)
    rows = compare_summaries(summary_a, summary_b)
    verdict = compare_verdict(summary_a, summary_b, max_step_time_regression_pct=max_regression_pct,
                              workload_a=_workload(a, summary_a.get("session_id")),
                              workload_b=_workload(b, summary_b.get("session_id")))
    if as_json:
        _print_json({"verdict": verdict, "metrics": rows})
        sys.exit(verdict["exit_code"])
    from rich.table import Table

    table = Table(title=f"{b} vs {a}", title_justify="left")
    for column in ("metric", "A", "B", "delta", "change"):
        table.add_column(column, justify="left" if column == "metric" else "right")

    def fmt(value: Any) -> str:
        return "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))

    for row in rows:
        change = "-" if row["relative"] is None else f"{row['relative'] * 100:+.1f}%"
        table.add_row(row["metric"], fmt(row["a"]), fmt(row["b"]), fmt(row["delta"]), change)
    console = _console()
    console.print(table)
    console.print(f"verdict {verdict['verdict']}: " + "; ".join(verdict["reasons"]), markup=False)
    sys.exit(verdict["exit_code"])


def _workload(target: Path | str, session_id: str | None = None) -> str | None:
    """The script a run ran (run.json's command line, its first word that is not an option), so
    two runs of different scripts are not compared as one workload; of a store URL, the
    session's ``command_line`` column."""
    try:
        if isinstance(target, str):
            from ..errors import StepwatchError
            from ..store import open_store

            try:
                store = open_store(target, read_only=True)
            except StepwatchError:
                return None
            try:
                found = store.query("SELECT command_line FROM sessions WHERE session_id = ?", (session_id,))
            except StepwatchError:
                found = []
            finally:
                store.close()
            command = json.loads(found[0]["command_line"]) if found and found[0]["command_line"] else None
        else:
            run_json = target / "run.json" if target.is_dir() else target.parent / "run.json"
            command = json.loads(run_json.read_text()).get("command_line")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    if not isinstance(command, list):
        return None
    words = [w for w in command if isinstance(w, str) and not w.startswith("-")]
    return Path(words[0]).name if words else None


@click.command("import")
@click.argument("path", type=click.Path(path_type=Path, exists=True))
@click.option("--into", "into", type=StoreTarget(), required=True,
              help="History store: a .sqlite file, a run directory (its history.sqlite), or a store URL "
                   "(clickhouse://user@host:9000/db; its database and tables are made when missing).")
@click.option("--json", "as_json", is_flag=True)
@_reports_errors
def import_command(path: Path, into: Path | str, as_json: bool) -> None:
    """Import artifacts (sink, JSON export, spool, heartbeat files, a whole run) into a store."""
    from ..store import open_store
    from ..store.importers import import_path

    store = open_store(into)
    try:
        written = import_path(path, store)
    finally:
        store.close()
    if as_json:
        _print_json(written)
    else:
        _console().print(f"imported into {into}: " + ", ".join(f"{n} {t}" for t, n in sorted(written.items())))
