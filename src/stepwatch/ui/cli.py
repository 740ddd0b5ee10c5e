"""The ``stepwatch`` command line: the command group, assembled here from the command modules
(which import nothing from this one).

Every reading command takes a run directory or any single artifact in it, prints with rich,
and prints JSON instead with ``--json``. Exit codes: 0 ok, 1 the artifact has invalid
records (``validate``), 2 the artifact cannot be read or the command line is wrong.
"""

from __future__ import annotations

import click

from .. import __version__
from .commands_capture import diagnose, track
from .commands_control import dump_stacks_command, halt, memory_snapshot
from .commands_export import export
from .commands_query import query
from .commands_read import inspect, sessions, validate
from .commands_run import compare, import_command, run, serve, summary
from .commands_top import top
from .commands_verdicts import explain
from .commands_watch import watch
from .commands_web import report, ui

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stepwatch")
def cli() -> None:
    """stepwatch: a flight recorder for deep-learning training runs."""


for _command in (validate, sessions, inspect, track, diagnose, run, serve, summary, compare, import_command, halt,
                 dump_stacks_command, memory_snapshot, watch, explain, top, ui, report, export, query):
    cli.add_command(_command)


def main() -> None:
    cli()


if __name__ == "__main__":  # pragma: no cover
    main()
