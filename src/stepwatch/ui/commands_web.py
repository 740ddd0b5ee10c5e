"""The web surfaces' commands: ``stepwatch ui`` (the dashboard) and ``stepwatch report`` (one HTML
file). docs/dashboard.md."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .base import StoreTarget, _console, _reports_errors, _soft_wrap

__all__ = ["report", "ui", "ui_token"]


def ui_token(token_env: str | None, host: str) -> str | None:
    """The dashboard's token from ``--token-env``; a usage error when the variable is empty, or
    when a bind other than loopback has none (a dashboard is never open to a network)."""
    from ..web.addresses import is_loopback
    from .feed_options import read_token

    token = read_token(token_env)
    if token is None and not is_loopback(host):
        raise click.UsageError(f"--host {host} is not loopback: the dashboard then needs a token (--token-env VAR)")
    return token


@click.command()
@click.argument("path", type=StoreTarget(), default=Path("stepwatch_runs"))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (anything but loopback needs --token-env).")
@click.option("--port", type=click.IntRange(0, 65535), default=8050, show_default=True, help="Port (0: any free).")
@click.option("--token-env", help="Name of the environment variable holding the access token.")
@_reports_errors
def ui(path: Path | str, host: str, port: int, token_env: str | None) -> None:
    """Serve the dashboard over PATH: a run directory, a history store (.sqlite), a serve --out
    directory, a directory of run directories (default: ./stepwatch_runs), or a store URL
    (clickhouse://host:9000/db: every session of the database).

    Read-only. Prints one JSON line with its URL; Ctrl-C stops it.
    """
    from ..errors import ArtifactError
    from ..web.app import serve_ui

    token = ui_token(token_env, host)
    if isinstance(path, Path) and not path.exists():
        raise ArtifactError(path, "no such file or directory")
    try:
        serve_ui(path, host=host, port=port, token=token)
    except OSError as exc:
        raise ArtifactError(f"{host}:{port}", f"cannot listen: {exc.strerror or exc}") from None


@click.command()
@click.argument("run_dir", type=StoreTarget(exists=True))
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Where to write the report (default: RUN_DIR/report.html, ./report.html for a store URL).")
@click.option("--session", "session_id", help="Session id (default: the run's own, else the newest).")
@_reports_errors
def report(run_dir: Path | str, out: Path | None, session_id: str | None) -> None:
    """Write one self-contained HTML report of a run: summary, diagnosis, charts, alerts, epochs
    and environment, with nothing to fetch (open it from a mail or a CI artifact)."""
    from ..views.sources import check_session_id
    from ..web.report import write_report

    if session_id is not None:
        try:
            check_session_id(session_id)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--session") from None
    target = write_report(run_dir, out, session_id)
    _console(stderr=True).print(f"[stepwatch] report: {target.resolve()} ({target.stat().st_size / 2**20:.1f} MiB)",
                                markup=False, soft_wrap=_soft_wrap(stderr=True))
    sys.stdout.write(f"{target}\n")
