"""What every command of the CLI shares: the console, JSON output, the exit codes and the
turning of stepwatch's own errors into one line on stderr."""

from __future__ import annotations

import sys
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


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped output is read by people in wide logs: do not wrap ids at 80 columns.
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 160)


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
            _console(stderr=True).print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(EXIT_UNREADABLE)

    return wrapper  # type: ignore[return-value]


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
legacy_option = click.option(
    "--strict/--permissive-legacy",
    default=True,
    help="Reject records without schema_version (default), or convert them as legacy records.",
)
