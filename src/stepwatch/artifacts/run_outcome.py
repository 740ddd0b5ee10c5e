"""How a run ended: the ``outcome`` of ``run.json`` and ``final_summary.json``, the ``error``
objects behind it, and the small per-rank end file each rank leaves in the run directory.

The sink's session statuses (``running``, ``completed``, ``interrupted``, ``incomplete``) say
whether the *capture* closed cleanly; they stay as the telemetry spec defines them. Whether the
*training* succeeded is a different question, answered here (docs/run-outcome.md):

- a rank records what ended it (an uncaught exception, a signal it could catch) in
  ``outcome_rank<N>.json`` as it happens, so it survives whatever comes after;
- the launcher (``stepwatch run``/``track``) adds what only it can see (the child's exit code or
  signal, torchrun's report of a rank that died without a word) and decides the run's outcome.

Nothing here imports torch; the writers are called from excepthooks and signal handlers and
must stay cheap.
"""

from __future__ import annotations

import signal
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError
from ._files import atomic_write_bytes

__all__ = [
    "OUTCOMES",
    "RANK_END_SCHEMA_VERSION",
    "decide_outcome",
    "fold_run_outcome",
    "last_heartbeats",
    "error_from_exception",
    "error_from_signal",
    "parse_torchrun_failures",
    "rank_end_path",
    "rank_outcome",
    "read_rank_end",
    "read_rank_ends",
    "signal_name",
    "write_rank_end",
]

RANK_END_SCHEMA_VERSION = 1
TORCHRUN_FAILURES = "torchrun_failures.json"  # written in torchrun's process as it ends (_autostart)
# Every value ``outcome`` takes, with what it means (docs/run-outcome.md says the same).
OUTCOMES: dict[str, str] = {
    "running": "not ended yet, or its launcher died before it could say how it ended",
    "succeeded": "the training exited with code 0 and no rank failed",
    "failed": "a rank raised an uncaught exception, or the training exited with a non-zero code",
    "killed": "a rank (or the training process) was ended by a signal nobody asked the run to stop with",
    "interrupted": "Ctrl-C: SIGINT reached the run, or a rank ended on KeyboardInterrupt",
    "halted": "stopped on request: every rank stopped at the step a `stepwatch halt` named, or the launcher "
              "was sent SIGTERM and passed it on to the training",
    "exited": "in-process view only (stepwatch.init() with no launcher): the program ended without an "
              "uncaught exception or a signal; its exit code is not visible from inside",
}
_MESSAGE_CHARS = 2000
_TRACEBACK_CHARS = 16_000


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _clip_tail(text: str, limit: int) -> str:
    # the end of a traceback (the raising frame and the message) is the part worth keeping
    return text if len(text) <= limit else "...\n" + text[-limit:]


def error_from_exception(exc: BaseException, tb: TracebackType | None, *, rank: int, thread: str,
                         fatal: bool, at_ns: int | None = None) -> dict[str, Any]:
    """The ``error`` object of an uncaught exception. ``fatal``: it ended the program (raised on
    the main thread); an exception that only ended another thread is recorded, not fatal."""
    typ = type(exc)
    name = typ.__qualname__ if typ.__module__ in ("builtins", "__main__") else f"{typ.__module__}.{typ.__qualname__}"
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that raises still leaves a usable record
        message = f"<unprintable {typ.__name__}>"
    try:
        text = "".join(traceback.format_exception(typ, exc, tb))
    except Exception:  # noqa: BLE001
        text = f"{name}: {message}\n"
    return {"kind": "exception", "rank": rank, "type": name, "message": message[:_MESSAGE_CHARS],
            "traceback": _clip_tail(text, _TRACEBACK_CHARS), "thread": thread, "fatal": fatal,
            "at_ns": at_ns if at_ns is not None else time.time_ns()}


def error_from_signal(signum: int, *, rank: int | None, at_ns: int | None = None, seen_by: str = "rank",
                      pid: int | None = None) -> dict[str, Any]:
    """The ``error`` object of a rank ended by a signal. ``seen_by``: ``rank`` (its own handler),
    ``launcher`` (the child's exit status) or ``torchrun`` (its report of a worker)."""
    name = signal_name(signum)
    who = "the training process" if rank is None else f"rank {rank}"
    error: dict[str, Any] = {"kind": "signal", "rank": rank, "type": name, "signal": name, "signal_number": signum,
                             "message": f"{who} was ended by {name}", "traceback": None, "fatal": True,
                             "seen_by": seen_by, "at_ns": at_ns if at_ns is not None else time.time_ns()}
    if pid is not None:
        error["pid"] = pid
    return error


def rank_outcome(errors: list[dict[str, Any]]) -> str:
    """One rank's own view of how it ended, from the errors it recorded (first fatal one wins)."""
    fatal = next((e for e in errors if e.get("fatal")), None)
    if fatal is None:
        return "exited"
    if fatal.get("kind") == "signal":
        return "interrupted" if fatal.get("signal") == "SIGINT" else "killed"
    return "interrupted" if fatal.get("type") == "KeyboardInterrupt" else "failed"


# -- the per-rank end file ------------------------------------------------------------------------


def rank_end_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"outcome_rank{rank}.json"


def write_rank_end(run_dir: Path, record: dict[str, Any]) -> None:
    """Replaces the rank's end file atomically; no fsync: it must survive the process, which the
    page cache does, and it is written from hooks that must not wait on the disk."""
    atomic_write_bytes(rank_end_path(run_dir, int(record["rank"])), msgspec.json.encode(record), fsync=False)


def read_rank_end(path: Path) -> dict[str, Any]:
    """One end file; ArtifactError naming the file and the field for anything malformed."""
    try:
        record = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    except DECODE_FAILURES as exc:
        raise ArtifactError(path, f"not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ArtifactError(path, "a rank end record must be a JSON object")
    for key, kind in (("session_id", str), ("rank", int), ("outcome", str), ("errors", list)):
        value = record.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ArtifactError(path, f"{key} must be a {kind.__name__}", field=f"$.{key}")
    for index, error in enumerate(record["errors"]):
        if not isinstance(error, dict) or not isinstance(error.get("kind"), str):
            raise ArtifactError(path, "each error must be an object with a kind", field=f"$.errors[{index}]")
        if not isinstance(error.get("at_ns"), int) or isinstance(error.get("at_ns"), bool):
            raise ArtifactError(path, "at_ns must be an integer", field=f"$.errors[{index}].at_ns")
    return record


def read_rank_ends(run_dir: Path, session_id: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The end records of ``session_id``'s ranks (a reused run directory holds other sessions'
    files too), and one line per file that could not be read."""
    ends: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    for path in sorted(run_dir.glob("outcome_rank*.json")):
        try:
            record = read_rank_end(path)
        except ArtifactError as exc:
            problems.append(str(exc))
            continue
        if record["session_id"] == session_id:
            ends[record["rank"]] = record
    return ends, problems


# -- torchrun's error file --------------------------------------------------------------------------


def parse_torchrun_failures(data: Any, session_id: str) -> list[dict[str, Any]]:
    """The failed workers torchrun named as it ended (``torchrun_failures.json``, written by
    the autostart hook in torchrun's process): rank, exit code (negative: the signal), time.
    Entries that are not well formed are left out; another session's file gives none."""
    if not isinstance(data, dict) or data.get("session_id") != session_id or not isinstance(data.get("failures"), list):
        return []
    failures = []
    for row in data["failures"]:
        if not isinstance(row, dict):
            continue
        rank, code, at_ns = row.get("rank"), row.get("exitcode"), row.get("at_ns")
        if type(rank) is not int or rank < 0 or type(code) is not int:
            continue
        failures.append({"rank": rank, "exitcode": code, "at_ns": at_ns if type(at_ns) is int and at_ns > 0 else None,
                         "pid": row.get("pid") if type(row.get("pid")) is int else None})
    return failures


# -- the run's outcome ------------------------------------------------------------------------------


def decide_outcome(*, returncode: int, rank_ends: dict[int, dict[str, Any]], world_size: int | None,
                   forwarded: list[int], torchrun_failures: list[dict[str, Any]] | None = None,
                   ended_at_ns: int | None = None, single_process: bool = True,
                   last_seen: dict[int, int] | None = None, local_ranks: range | None = None
                   ) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    """(outcome, the error that decided it or None, every rank's errors by time).

    ``returncode``: the training process's, as ``subprocess`` gives it (negative: a signal).
    ``forwarded``: the signals the launcher was sent and passed on. ``single_process``: the
    child is rank 0 itself (no torchrun), so its signal is that rank's. ``last_seen``: per rank,
    the time of its last heartbeat record (dates a rank that died without a word).
    ``local_ranks``: the ranks this node started (default: all of ``world_size``).
    """
    ended_at_ns = ended_at_ns if ended_at_ns is not None else time.time_ns()
    errors: list[dict[str, Any]] = [e for end in rank_ends.values() for e in end.get("errors", [])
                                    if isinstance(e, dict)]
    signalled = {e.get("rank") for e in errors if e.get("kind") == "signal"}
    if single_process and returncode < 0 and 0 not in signalled and not _rank_raised(rank_ends, 0):
        errors.append(error_from_signal(-returncode, rank=0, at_ns=ended_at_ns, seen_by="launcher"))
    reported = {f["rank"]: f for f in torchrun_failures or [] if f.get("exitcode", 0) < 0}
    if not single_process and returncode != 0 and world_size:
        # a rank that left no end record died without a word: a signal it cannot catch (SIGKILL,
        # the kernel's OOM killer) or a crash. Its last sign of life dates it. Only this node's
        # ranks: the others leave their end files on their own nodes.
        for rank in (local_ranks if local_ranks is not None else range(world_size)):
            if rank in rank_ends:
                continue
            failure = reported.get(rank)
            at_ns = (last_seen or {}).get(rank) or (failure or {}).get("at_ns") or ended_at_ns
            if failure is not None:
                errors.append(error_from_signal(-failure["exitcode"], rank=rank, at_ns=at_ns, seen_by="torchrun",
                                                pid=failure.get("pid")))
            else:
                errors.append(_mute_rank(rank, at_ns))
    errors.sort(key=lambda e: (e.get("at_ns") or 0, e.get("rank") if isinstance(e.get("rank"), int) else -1))
    fatal = [e for e in errors if e.get("fatal")]
    halt = _halt_error(rank_ends)
    if halt is not None and not fatal and (returncode == 0 or not forwarded and returncode > 0):
        return "halted", halt, errors  # ``stepwatch halt``: the ranks stopped at its step (Halt's exit code)
    if returncode == 0:  # whatever a rank saw on the way, the training says it succeeded
        return "succeeded", None, errors
    if signal.SIGINT in forwarded:
        return "interrupted", (fatal[0] if fatal else None), errors
    if signal.SIGTERM in forwarded:
        return "halted", (fatal[0] if fatal else None), errors
    if fatal:
        first = fatal[0]
        return rank_outcome([first]), first, errors
    if returncode < 0:
        error = error_from_signal(-returncode, rank=None, at_ns=ended_at_ns, seen_by="launcher")
        errors.append(error)
        return ("interrupted" if -returncode == signal.SIGINT else "killed"), error, errors
    return "failed", None, errors


def _halt_error(rank_ends: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The ranks' halt (``stepwatch halt``, docs/halt.md) as the run's ``error``: the first
    rank's record, with the step every rank stopped at (``steps``: by rank)."""
    halts = {rank: end["halt"] for rank, end in sorted(rank_ends.items()) if isinstance(end.get("halt"), dict)}
    if not halts:
        return None
    first = dict(next(iter(halts.values())))
    steps = {str(rank): h.get("step") for rank, h in halts.items()}
    first.update(rank=None if len(halts) > 1 else first.get("rank"), steps=steps)
    if len(set(steps.values())) == 1:
        first["message"] = f"halted at step {first.get('step')} on request: {first.get('reason')}"
    else:
        first["message"] = f"halted on request at steps {steps} (not all the same): {first.get('reason')}"
    return first


def _mute_rank(rank: int, at_ns: int) -> dict[str, Any]:
    return {"kind": "signal", "rank": rank, "type": "no end record", "signal": None, "signal_number": None,
            "message": f"rank {rank} ended without a word (no end record): killed by a signal it cannot catch "
                       "(SIGKILL, the OOM killer) or crashed; at_ns is its last sign of life",
            "traceback": None, "fatal": True, "seen_by": "launcher", "at_ns": at_ns}


def _rank_raised(rank_ends: dict[int, dict[str, Any]], rank: int) -> bool:
    end = rank_ends.get(rank)
    return end is not None and any(e.get("fatal") for e in end.get("errors", []) if isinstance(e, dict))


# -- folding it all into run.json ------------------------------------------------------------------


def last_heartbeats(run_dir: Path, world_size: int, skip: set[int]) -> dict[int, int]:
    """Per rank not in ``skip``, the time (ns) of its last heartbeat record: a rank that died
    without a word was last alive then."""
    from .heartbeat import heartbeat_filename, read_heartbeat

    seen: dict[int, int] = {}
    for rank in range(world_size):
        path = run_dir / heartbeat_filename(rank)
        if rank in skip or not path.is_file():
            continue
        try:
            records = read_heartbeat(path)
        except (ArtifactError, RecursionError):
            continue
        if records:
            seen[rank] = int(records[-1]["ts"] * 1e9)
    return seen


def fold_run_outcome(run_dir: Path, manifest: Any, returncode: int, forwarded: list[int], *,
                     single_process: bool) -> list[str]:
    """Sets ``manifest.outcome``, ``.error`` and ``.errors`` from the ranks' end files, the
    training's exit status and torchrun's report; returns a line per input it had to leave out.
    ``single_process``: the launcher's child is rank 0 itself (not torchrun & co.)."""
    ends, unreadable = read_rank_ends(run_dir, manifest.session_id)
    problems = [f"a rank's end record is unreadable, the outcome is decided without it: {p}" for p in unreadable]
    failures: list[dict[str, Any]] = []
    report = run_dir / TORCHRUN_FAILURES
    if not single_process and report.is_file():
        try:
            failures = parse_torchrun_failures(msgspec.json.decode(report.read_bytes()), manifest.session_id)
        except (OSError, *DECODE_FAILURES) as exc:
            problems.append(f"{report}: unreadable, the outcome is decided without it: {exc}")
    nnodes, node_rank = manifest.extra.get("nnodes"), manifest.extra.get("node_rank")
    local_ranks = None
    if type(nnodes) is int and type(node_rank) is int and nnodes > 1:
        per_node = manifest.world_size // nnodes
        local_ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    manifest.outcome, manifest.error, manifest.errors = decide_outcome(
        returncode=returncode, rank_ends=ends, world_size=manifest.world_size, forwarded=forwarded,
        torchrun_failures=failures, ended_at_ns=manifest.ended_at_ns, single_process=single_process,
        last_seen=None if single_process else last_heartbeats(run_dir, manifest.world_size, set(ends)),
        local_ranks=local_ranks)
    return problems
