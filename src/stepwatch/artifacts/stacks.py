"""Stack dumps of running ranks: every thread's Python stack, on request, from outside.

Each rank registers ``faulthandler`` on a signal at init (``capture/runtime.py``; SIGUSR2 by
default), writing into ``<run>/stacks/<name>.faulthandler`` (``<name>`` is ``rank<N>``, or
``rank<N>-p<pid>``), and says so in its heartbeat ``boot`` record (``stack_signal``,
``stack_file``). The dump is written by the signal handler in C, without the GIL: a rank stuck
in C code that holds the GIL, or in a collective, still dumps; a Python thread reading frames
would wait for the GIL forever.

``dump_stacks`` signals every local rank at once (their stacks are then of the same moment),
waits until each rank's file has grown and stopped growing, and copies the new bytes into
``<run>/stacks/<name>-<unix_ts>.txt`` (``docs/stacks.md``).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from ..errors import StepwatchError
from ._files import atomic_write_bytes
from .live_ranks import RankProcess, rank_processes, require_run_dir

__all__ = ["STACKS_DIR", "StackDumps", "NoStackDump", "dump_stacks", "stack_file_name"]

STACKS_DIR = "stacks"
_SETTLE_S = 0.15  # a dump is complete once its file has not grown for this long
_POLL_S = 0.02


class NoStackDump(StepwatchError):
    """No rank of the run could be dumped; the message says why for each."""


class StackDumps(list[Path]):
    """The dump files written (one per rank that answered), oldest rank first; ``problems``
    maps each rank process that was not dumped (``rank<N>``) to why: stopped, on another host,
    gone, no signal registered, no answer within the timeout."""

    def __init__(self, paths: Iterable[Path] = (), problems: dict[str, str] | None = None) -> None:
        super().__init__(paths)
        self.problems: dict[str, str] = problems or {}


def stack_file_name(name: str) -> str:
    """The file a rank's faulthandler writes into (under ``<run>/stacks/``)."""
    return f"{name}.faulthandler"


def dump_stacks(run_dir: str | os.PathLike[str], *, ranks: Iterable[int] | None = None, timeout_s: float = 5.0,
                reason: str = "requested with stepwatch dump-stacks") -> StackDumps:
    """Dumps the stacks of the run's live local ranks (``ranks``: only these) and returns the
    files written, with ``problems`` naming the ranks that could not be dumped and why.

    Raises ``ArtifactError`` when ``run_dir`` is not a run directory, ``NoStackDump`` when no
    rank (of ``ranks``) has a process in it at all.
    """
    root = require_run_dir(run_dir)
    wanted = None if ranks is None else set(ranks)
    processes = [p for p in rank_processes(root) if wanted is None or p.rank in wanted]
    if not processes:
        which = "no rank" if wanted is None else f"no rank {sorted(wanted)}"
        raise NoStackDump(f"{root}: {which} has a boot record in its heartbeat files: nothing to dump")
    problems: dict[str, str] = {}
    pending: list[tuple[RankProcess, Path, int, int]] = []  # rank, its file, size before, signal
    directory = root / STACKS_DIR
    with _DumpLock(directory):
        for process in processes:
            problem = _why_not(process)
            if problem is not None:
                problems[process.name] = problem
                continue
            assert process.stack_signal is not None and process.stack_file is not None
            path = root / process.stack_file
            try:
                before = path.stat().st_size
            except OSError as exc:
                problems[process.name] = f"cannot read its stack file {path}: {exc.strerror or exc}"
                continue
            try:
                os.kill(process.pid, process.stack_signal)
            except ProcessLookupError:
                problems[process.name] = f"process {process.pid} is gone"
                continue
            except PermissionError:
                problems[process.name] = f"not allowed to signal process {process.pid} (another user's)"
                continue
            pending.append((process, path, before, process.stack_signal))
        grown = _wait_for_dumps([(path, before) for _, path, before, _ in pending], timeout_s)
        written = StackDumps(problems=problems)
        stamp = int(time.time())
        for (process, path, before, signum), size in zip(pending, grown):
            if size is None:
                problems[process.name] = (f"no dump within {timeout_s:g} s after {_signal_name(signum)} "
                                          f"(process {process.pid} may be ending or its handler was replaced)")
                continue
            try:
                with path.open("rb") as file:
                    file.seek(before)
                    data = file.read(size - before)
                written.append(_write_dump(directory, process, data, stamp, signum, reason))
            except OSError as exc:
                problems[process.name] = f"cannot copy its dump: {exc.strerror or exc}"
    if not written:
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise NoStackDump(f"{root}: no rank could be dumped ({lines})")
    return written


def _why_not(process: RankProcess) -> str | None:
    if process.stopped:
        return "it has stopped (a stop record follows its boot)"
    if not process.local:
        return f"it runs on host {process.host}, not this one ({socket.gethostname()}): run dump-stacks there"
    if process.stack_signal is None or process.stack_file is None:
        return ("it registered no stack dump signal (an older stepwatch, STEPWATCH_STACK_SIGNAL=off, "
                "or the program has its own handler on the signal)")
    if not process.alive():
        return f"process {process.pid} is gone"
    return None


def _wait_for_dumps(files: list[tuple[Path, int]], timeout_s: float) -> list[int | None]:
    """Per file, its size once it has grown past its size before and then not grown for
    ``_SETTLE_S`` (None: it did not grow before the timeout)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    sizes: list[int | None] = [None] * len(files)
    changed = [0.0] * len(files)
    done = [False] * len(files)
    while not all(done):
        now = time.monotonic()
        for i, (path, before) in enumerate(files):
            if done[i]:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size > before and size != sizes[i]:
                sizes[i], changed[i] = size, now
            elif sizes[i] is not None and now - changed[i] >= _SETTLE_S:
                done[i] = True
        if now >= deadline:
            break
        time.sleep(_POLL_S)
    return sizes


def _write_dump(directory: Path, process: RankProcess, data: bytes, stamp: int, signum: int, reason: str) -> Path:
    path = directory / f"{process.name}-{stamp}.txt"
    serial = 1
    while path.exists():
        path = directory / f"{process.name}-{stamp}-{serial}.txt"
        serial += 1
    iso = datetime.fromtimestamp(stamp, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    header = (f"# stepwatch stack dump: rank {process.rank} ({process.name}), pid {process.pid} on "
              f"{process.host or socket.gethostname()}, step {process.step}, {_signal_name(signum)} at {iso}\n"
              f"# reason: {' '.join(reason.split())[:500]}\n")
    atomic_write_bytes(path, header.encode() + data, fsync=False)
    return path


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _DumpLock:
    """One dump at a time per run directory: two at once would each copy both dumps."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / ".dump.lock"
        self.fd: int | None = None

    def __enter__(self) -> _DumpLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            import fcntl

            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except (OSError, ImportError):  # a read-only run directory: dump without the lock
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None
