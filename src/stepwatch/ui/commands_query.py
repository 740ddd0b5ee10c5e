"""``stepwatch query``: read-only SQL over a run's history, or one of the named questions
(docs/query.md). The store is opened read-only (store/user_query.py): a write is refused by
SQLite and changes nothing.

Exit codes: 0 answered; 2 the input cannot be read, the SQL fails or is refused, or the
command line is wrong.
"""

from __future__ import annotations

import csv
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import msgspec

from .base import StoreTarget, _console, _reports_errors

__all__ = ["query"]

TABLE_ROWS = 1000  # a terminal table shows this many rows; json and csv stream them all


@contextmanager
def _history_file(path: Path) -> Iterator[Path]:
    """The history store file of ``path``: itself (a .sqlite/.db), a run directory's
    history.sqlite, or, for a run with no history (``track``, ``stepwatch.init`` alone), a
    temporary store its artifacts are imported into (nothing is written into the run)."""
    from ..errors import ArtifactError

    if path.is_file() and path.suffix in (".sqlite", ".db"):
        yield path
        return
    if not path.exists():
        raise ArtifactError(path, "no such file or directory")
    if not path.is_dir():
        raise ArtifactError(path, "not a run directory or a history store (history.sqlite)")
    if (path / "history.sqlite").is_file():
        yield path / "history.sqlite"
        return
    from ..store.importers import import_path
    from ..store.sqlite import SqliteStore

    with tempfile.TemporaryDirectory(prefix="stepwatch-query-") as tmp:
        target = Path(tmp) / "history.sqlite"
        with SqliteStore(target) as store:
            try:
                import_path(path, store)
            except ArtifactError as exc:
                raise ArtifactError(path, f"not a run directory (no history.sqlite; {exc.reason})") from None
        yield target


def _plain(value: Any) -> Any:
    return value.hex() if isinstance(value, (bytes, bytearray, memoryview)) else value


@click.command()
@click.argument("path", type=StoreTarget())
@click.argument("sql", required=False)
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True,
              help="table for people; json (an array of objects) or csv for scripts.")
@click.option("--sessions", "named", flag_value="sessions", help="Every session: status, start, duration, ranks.")
@click.option("--ooms", "named", flag_value="ooms", help="The out-of-memory errors, with the memory then.")
@click.option("--alerts", "named", flag_value="alerts", help="The watchdog's alerts, oldest first.")
@click.option("--rank-skew", "named", flag_value="rank-skew", help="Per rank: step time against the others, lag, wait.")
@click.option("--slowest-steps", type=click.IntRange(1, 1_000_000), metavar="N", help="The N slowest steps.")
@click.option("--session", "session_id", help="Named questions: only this session (default: every one).")
@_reports_errors
def query(path: Path | str, sql: str | None, fmt: str, named: str | None, slowest_steps: int | None,
          session_id: str | None) -> None:
    """Read-only SQL over a run's history (PATH: a run directory, a history store, or a store URL
    such as clickhouse://default@host:9000/stepwatch), or a named
    question. Views: sessions, steps, telemetry, spans, marks, alerts, verdicts, heartbeats,
    snapshots (their columns: docs/query.md). Example:

    \b
        stepwatch query RUN "SELECT rank, AVG(step_ns) / 1e6 AS ms
                             FROM steps GROUP BY rank"
    """
    from ..store.user_query import ask, named_question

    if slowest_steps is not None:
        if named is not None:
            raise click.UsageError("give one named question at a time")
        named = "slowest-steps"
    if (sql is None) == (named is None):
        raise click.UsageError("give either SQL or one named question (--sessions, --ooms, --alerts, "
                               "--slowest-steps N, --rank-skew)")
    if session_id is not None and named is None:
        raise click.UsageError("--session narrows a named question; in SQL write WHERE session_id = '...'")
    statement, params = (sql, ()) if sql is not None else named_question(named or "", session_id, slowest_steps)
    if isinstance(path, str):  # a store URL
        from ..store.user_query import ask_named_url, ask_url

        if named is not None:
            with ask_named_url(path, named, session_id, slowest_steps) as answer:
                _answer(answer, fmt, named)
            return
        with ask_url(path, statement or "", params) as answer:
            _answer(answer, fmt, "query")
        return
    with _history_file(path) as history, ask(history, statement or "", params) as answer:
        _answer(answer, fmt, named or "query")


def _answer(answer: Any, fmt: str, title: str) -> None:
    """Prints ``answer`` (store.user_query.Answer) in ``fmt``."""
    if fmt == "json":
        _write_json(answer.columns, answer.rows)
    elif fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(answer.columns)
        for row in answer.rows:
            writer.writerow([_plain(v) for v in row])
    else:
        _print_table(answer.columns, answer.rows, title)


def _write_json(columns: list[str], rows: Iterator[tuple[Any, ...]]) -> None:
    """A JSON array of one object per row, written as the rows come."""
    encode = msgspec.json.Encoder().encode
    out = sys.stdout
    out.write("[")
    first = True
    for row in rows:
        out.write(("\n  " if first else ",\n  ") + encode(dict(zip(columns, map(_plain, row)))).decode())
        first = False
    out.write("\n]\n" if not first else "]\n")


def _print_table(columns: list[str], rows: Iterator[tuple[Any, ...]], title: str) -> None:
    from rich.table import Table
    from rich.text import Text

    console = _console()
    if not columns:
        console.print("(the statement returned no columns)")
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    shown = more = 0
    for row in rows:
        if shown < TABLE_ROWS:
            # Text, not markup: a value such as "[red]" is shown as it is
            table.add_row(*(Text("" if v is None else str(_plain(v))) for v in row))
            shown += 1
        else:
            more += 1
    console.print(table)
    note = f"{shown} row{'s' * (shown != 1)}"
    if more:
        note += f" shown, {more} more not (--format csv or json gives them all)"
    console.print(note, markup=False)
