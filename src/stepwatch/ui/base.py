"""What every command of the CLI shares: the console, JSON output, the exit codes and the
turning of stepwatch's own errors into one line on stderr."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click
import msgspec

from ..errors import StepwatchError

__all__ = ["EXIT_INVALID", "EXIT_UNREADABLE", "json_option", "legacy_option"]

F = TypeVar("F", bound=Callable[..., Any])
EXIT_INVALID = 1
EXIT_UNREADABLE = 2


PIPED_WIDTH = 160


def _columns(stderr: bool = False) -> int | None:
    """The width to fit the output to: the terminal's; on a pipe, ``COLUMNS`` where it is set
    (a wrapper that shows the output in a terminal of that width, a test); else None."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return shutil.get_terminal_size().columns
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def _soft_wrap(stderr: bool = False) -> bool:
    """Whether a long line may stay one line: only on a pipe nobody gave a width (a wide log)."""
    return _columns(stderr) is None


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    # Piped output is read by people in wide logs: do not wrap ids at 80 columns, unless COLUMNS
    # says how wide the reader is.
    columns = _columns(stderr)
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    return Console(stderr=stderr, highlight=False, width=None if tty else (columns or PIPED_WIDTH))


def _fit_text(text: str, stderr: bool = False) -> str:
    """Plain text (a summary, an explanation) folded to the reader's width, each folded line
    indented under its own start plus two, so nothing a terminal shows is cut; unchanged on a
    pipe with no width (the files and logs keep one line per fact)."""
    width = _columns(stderr)
    if width is None:
        return text
    out: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
        out += textwrap.wrap(line, width=width, subsequent_indent=indent, break_on_hyphens=False) or [""]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def _reports_errors(func: F) -> F:
    """Turns stepwatch's own errors into one clear line on stderr and exit code 2."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except StepwatchError as exc:
            # soft_wrap: one line however long the path in it (the console wraps at 160 columns)
            from rich.markup import escape  # a message's own brackets ("stepwatch[mlflow]") are text

            _console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False,
                                        soft_wrap=True)
            sys.exit(EXIT_UNREADABLE)

    return wrapper  # type: ignore[return-value]


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
legacy_option = click.option(
    "--strict/--permissive-legacy",
    default=True,
    help="Reject records without schema_version (default), or convert them as legacy records.",
)


class StoreTarget(click.ParamType):
    """A run directory or history store path (a ``Path``), or a store URL (``clickhouse://...``,
    kept as the ``str`` it is: a Path would fold its ``//``). A URL is checked here, so a bad one
    is a usage error naming its bad part before anything connects; ``exists``: a path must exist."""

    name = "PATH|URL"

    def __init__(self, exists: bool = False) -> None:
        self.exists = exists

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from pathlib import Path

        if isinstance(value, str) and "://" in value:
            from ..errors import StoreError
            from ..store.clickhouse_url import is_clickhouse_url, parse_clickhouse_url

            try:
                if not is_clickhouse_url(value):
                    raise StoreError(f"store URL {value!r}: scheme: only clickhouse:// URLs name a store")
                parse_clickhouse_url(value)
            except StoreError as exc:
                self.fail(str(exc), param, ctx)
            return value
        path = Path(value)
        if self.exists and not path.exists():
            self.fail(f"{str(path)!r}: no such file or directory", param, ctx)
        return path
