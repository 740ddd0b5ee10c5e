"""Commands that act on a running job: ``halt``, ``dump-stacks``, ``memory-snapshot``.

Exit codes (docs/halt.md, docs/stacks.md): 0 done; 2 bad input (not a run directory, a step
already passed, no running rank, the request file cannot be written); 3 ``dump-stacks`` found
ranks but none could be dumped (each one's reason is printed).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .base import EXIT_UNREADABLE, _console, _print_json, _reports_errors

__all__ = ["EXIT_NOTHING_DUMPED", "dump_stacks_command", "halt", "memory_snapshot"]

EXIT_NOTHING_DUMPED = 3


def _error(message: str, code: int) -> None:
    _console(stderr=True).print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    sys.exit(code)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--at-step", type=int, default=None,
              help="Stop once every rank has completed this step (default: the nearest step every running "
                   "rank can still reach, from their step rates). A step some rank has passed is refused.")
@click.option("--reason", default="requested with stepwatch halt", show_default=True,
              help="Why: recorded in .HALT, the ranks' end files, run.json and the final summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the request written, as JSON.")
@_reports_errors
def halt(run_dir: Path, at_step: int | None, reason: str, as_json: bool) -> None:
    """Stop every rank of a running job at the same step boundary (writes RUN_DIR/.HALT).

    Each rank's background thread reads the request within a second; once a rank has completed
    the target step, stepwatch.halt_requested() is true (a loop can save a checkpoint and stop),
    and the training thread's next phase or step raises stepwatch.Halt (SystemExit, exit code 0;
    STEPWATCH_HALT_EXIT_CODE to change it). Removing .HALT before then cancels it. The run's
    outcome is `halted` (docs/halt.md). Exit codes: 0 written, 2 not a run directory / step passed / no running rank /
    cannot write.
    """
    from ..artifacts.halt import request_halt

    request = request_halt(run_dir, at_step=at_step, reason=reason)
    if as_json:
        import msgspec

        _print_json(msgspec.to_builtins(request))
        return
    how = "chosen from the ranks' step rates" if request.chosen else "as asked"
    print(f"halt requested at step {request.target_step} ({how}): {run_dir / '.HALT'}")
    for name, basis in sorted(request.basis.get("ranks", {}).items()):
        rate = f"{basis['steps_per_s']:.2f} steps/s" if basis.get("steps_per_s") else "rate unknown"
        print(f"  {name}: at step {basis['step']}, {rate}")


@click.command("dump-stacks")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True,
              help="Only this rank (repeatable; default every rank on this host).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, 600), default=5.0, show_default=True,
              help="Seconds to wait for each rank's dump.")
@click.option("--reason", default="requested with stepwatch dump-stacks", show_default=True,
              help="Written at the top of each dump.")
@_reports_errors
def dump_stacks_command(run_dir: Path, ranks: tuple[int, ...], timeout_s: float, reason: str) -> None:
    """Dump the Python stacks of every thread of the job's running ranks on this host.

    Each rank writes them from a faulthandler signal handler (SIGUSR2 unless
    STEPWATCH_STACK_SIGNAL says otherwise), so a rank stuck in C code or a collective dumps too.
    Prints each file written (RUN_DIR/stacks/rank<N>-<unix time>.txt), and on stderr each rank
    that could not be dumped and why. Exit codes: 0 at least one dump, 2 not a run directory or
    no such rank, 3 no rank could be dumped.
    """
    from ..artifacts.stacks import NoStackDump, dump_stacks

    try:
        written = dump_stacks(run_dir, ranks=ranks or None, timeout_s=timeout_s, reason=reason)
    except NoStackDump as exc:
        _error(str(exc), EXIT_NOTHING_DUMPED if "no rank could be dumped" in str(exc) else EXIT_UNREADABLE)
        return
    for path in written:
        print(path)
    console = _console(stderr=True)
    for name, why in sorted(written.problems.items()):
        console.print(f"[stepwatch] {name} not dumped: {why}", markup=False)


@click.command("memory-snapshot")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--reason", default="requested with stepwatch memory-snapshot", show_default=True)
@click.option("--wait", "wait_s", type=click.FloatRange(0, 600), default=5.0, show_default=True,
              help="Seconds to wait for the ranks' answers (0: do not wait).")
@_reports_errors
def memory_snapshot(run_dir: Path, reason: str, wait_s: float) -> None:
    """Ask every running rank for a CUDA memory snapshot (RUN_DIR/memory_snapshots/).

    A rank that uses CUDA writes torch.cuda.memory._dump_snapshot (open it at
    https://pytorch.org/memory_viz); a CPU-only rank answers that it has no CUDA. Prints each
    answer that came within --wait. Exit codes: 0 requested, 2 not a run directory / cannot write.
    """
    from ..artifacts.live_ranks import live_ranks
    from ..artifacts.memory_snapshots import read_memory_snapshot_answers, request_memory_snapshot

    request = request_memory_snapshot(run_dir, reason=reason)
    expected = len(live_ranks(run_dir))
    print(f"memory snapshot requested ({request.request_id}) of {expected} running rank(s)")
    deadline = time.monotonic() + wait_s
    answers: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        answers = read_memory_snapshot_answers(run_dir, request.request_id)
        if len(answers) >= expected:
            break
        time.sleep(0.1)
    for answer in answers:
        detail = answer.get("path") or answer.get("note") or ""
        print(f"  {answer.get('name')}: {answer.get('status')} {detail}")
