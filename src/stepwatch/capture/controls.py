"""What a rank does when asked from outside: dump its stacks, stop at a step, snapshot its CUDA
memory; and the phase it is in, for its heartbeat.

Everything here runs at init or on the sampler thread, never on a training step: the stack dump
signal is ``faulthandler``'s C handler; the ``.HALT`` and ``.MEMORY_SNAPSHOT`` request files are
read at the sampler's tick; the current phase is read from the training thread's span stack
(plain attribute reads of objects that thread owns). The one thing the training thread does is
the halt itself, at a step boundary (``HaltController``'s trap, halt_control.py), and only once a
halt has been requested (``docs/halt.md``, ``docs/stacks.md``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from ..artifacts.halt import HALT_FILENAME, HaltRequest, parse_halt
from ..artifacts.memory_snapshots import (
    MEMORY_SNAPSHOT_FILENAME,
    MEMORY_SNAPSHOTS_DIR,
    MemorySnapshotRequest,
    parse_memory_snapshot_request,
)
from ..artifacts.stacks import STACKS_DIR, stack_file_name
from ..guard import logger

__all__ = [
    "HALT_EXIT_CODE_ENV", "HALT_FILENAME", "MEMORY_HISTORY_ENV", "MEMORY_SNAPSHOT_FILENAME", "STACK_SIGNAL_ENV", "Halt",
    "RequestFile", "answer_memory_snapshot", "cuda_in_use", "current_phase", "dump_cuda_snapshot", "halt_exit_code",
    "memory_history_from_env", "read_halt_request", "read_snapshot_request", "record_memory_history",
    "register_stack_signal", "stack_signal_from_env", "training_thread",
]

STACK_SIGNAL_ENV = "STEPWATCH_STACK_SIGNAL"
HALT_EXIT_CODE_ENV = "STEPWATCH_HALT_EXIT_CODE"
MEMORY_HISTORY_ENV = "STEPWATCH_MEMORY_HISTORY"
_DEFAULT_STACK_SIGNAL = "SIGUSR2"
_OFF = frozenset({"", "0", "off", "none", "no", "false"})
_said: set[str] = set()
# The signal this process registered, and the file it writes into (kept open for the process's
# life: faulthandler writes to its descriptor).
_registered: tuple[int, Any] | None = None


class Halt(SystemExit):
    """Raised into the training loop at the step boundary a ``stepwatch halt`` asked for (the
    first phase or ``trace_step`` after the target step completed). A ``SystemExit``: the
    program ends with ``code`` (0 unless ``STEPWATCH_HALT_EXIT_CODE`` says otherwise) and no
    traceback, after its ``finally`` blocks and atexit handlers; the run's outcome is
    ``halted``. A loop that wants to save first checks ``stepwatch.halt_requested()`` after its
    optimizer step and stops itself."""

    def __init__(self, step: int, reason: str, code: int = 0) -> None:
        super().__init__(code)
        self.step = step
        self.reason = reason

    def __str__(self) -> str:
        return f"halted at step {self.step} on request: {self.reason}"


def halt_exit_code(env: dict[str, str] | os._Environ[str] | None = None) -> int:
    """``Halt``'s exit code: ``STEPWATCH_HALT_EXIT_CODE`` (0-255), else 0."""
    value = (os.environ if env is None else env).get(HALT_EXIT_CODE_ENV, "").strip()
    if value.isdigit() and int(value) <= 255:
        return int(value)
    if value:
        _say_once("halt-code", f"{HALT_EXIT_CODE_ENV}={value!r} is not a number 0-255; Halt exits with 0")
    return 0


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning("stepwatch: %s", message)


# -- stack dumps ---------------------------------------------------------------------------------


def stack_signal_from_env(env: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """The signal to register (``STEPWATCH_STACK_SIGNAL``: a name such as ``SIGUSR1``, a
    number, or ``off``); SIGUSR2 by default; None where there is none to use."""
    value = (os.environ if env is None else env).get(STACK_SIGNAL_ENV)
    value = _DEFAULT_STACK_SIGNAL if value is None else value.strip()
    if value.lower() in _OFF:
        return None
    try:
        if value.isdigit():
            return int(signal.Signals(int(value)))
        name = value.upper()
        return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except (KeyError, ValueError):
        _say_once("stack-signal", f"{STACK_SIGNAL_ENV}={value!r} names no signal; no stack dumps on request")
        return None


def register_stack_signal(run_dir: Path, name: str) -> tuple[int, str] | None:
    """Registers ``faulthandler`` on the stack dump signal, writing every thread's stack into
    ``<run>/stacks/<name>.faulthandler``; returns (signal, that path relative to the run) or
    None. A signal the program handles itself is left alone (said once)."""
    global _registered
    import faulthandler

    signum = stack_signal_from_env()
    if signum is None or not hasattr(faulthandler, "register"):
        return None
    current = signal.getsignal(signum)
    ours = _registered is not None and _registered[0] == signum and current is None  # faulthandler's is C-level
    if not (ours or current == signal.SIG_DFL):
        _say_once("stack-handler", f"the program has its own handler for {signal.Signals(signum).name}: "
                                   f"stepwatch registers no stack dumps there (set {STACK_SIGNAL_ENV} to another signal)")
        return None
    relative = f"{STACKS_DIR}/{stack_file_name(name)}"
    path = run_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "ab", buffering=0)  # noqa: SIM115 - held open for the process's life
    faulthandler.register(signum, file=file, all_threads=True, chain=False)
    previous, _registered = _registered, (signum, file)
    if previous is not None and previous[1] is not file:
        try:
            previous[1].close()  # a second init in this process: its new run directory's file
        except OSError:
            pass
    return signum, relative


# -- the phase the training thread is in -------------------------------------------------------------

_STEPS = frozenset({"step", "eval_step"})


def _training_state(training: Any) -> Any:
    """The bookkeeping of the thread that trains: the one with the latest open step, else one
    with open spans."""
    states = getattr(training, "thread_states", None)
    if not states:
        return None
    if len(states) > 8:  # threads that ran phases and ended: forget them
        alive = {t.ident for t in threading.enumerate()}
        for ident in [i for i in list(states) if i not in alive]:
            states.pop(ident, None)
    chosen = None
    for state in list(states.values()):
        step = state.step
        newer = step is not None and (chosen is None or chosen.step is None or step.start_ns > chosen.step.start_ns)
        if newer or (chosen is None and state.stack):
            chosen = state
    return chosen


def training_thread(training: Any) -> int | None:
    """The ident of the thread that trains (None: not known yet)."""
    state = _training_state(training)
    return state.ident if state is not None else None


def current_phase(training: Any, now_ns: int) -> tuple[str | None, float | None]:
    """(innermost open phase or scope of the training thread, seconds in it), or (None, None)
    between steps. Inside a step with no phase open, the phase is ``step``.

    Read from the sampler thread: the training thread's bookkeeping (``thread_states``) and
    span stack are plain objects; a copy of the stack is taken in C (``list(...)``), so a span
    pushed or popped meanwhile gives the state just before or after, never a torn one.
    """
    chosen = _training_state(training)
    if chosen is None:
        return None, None
    stack = list(chosen.stack)
    if not stack:
        return None, None
    inner = stack[-1]
    if inner.name in _STEPS:
        # an inferred step whose optimizer step returned stays open for marks: between steps
        if chosen.live is not inner:
            return None, None
    elif inner.name == "epoch":
        return None, None
    return inner.name, round(max(0, now_ns - inner.start_ns) / 1e9, 3)


# -- request files read at the sampler's tick -----------------------------------------------------


class RequestFile:
    """A request file the sampler looks at each tick: one ``stat``; read and parsed only when
    it changed. ``poll`` returns the new content (None when unchanged, gone, or unreadable:
    said once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self.present = False  # the file existed at the last poll

    def poll(self) -> bytes | None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen = None
            self.present = False
            return None
        self.present = True
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._seen:
            return None
        self._seen = key
        try:
            return self.path.read_bytes()
        except OSError as exc:
            _say_once(f"read:{self.path}", f"cannot read {self.path}: {exc}")
            return None


def read_halt_request(data: bytes, path: Path, session_id: str) -> HaltRequest | None:
    """The request in ``data`` if it is meant for this session (said once otherwise)."""
    try:
        request = parse_halt(data, path)
    except ValueError as exc:
        _say_once(f"halt:{data[:64]!r}", f"ignoring {path}: {exc}")
        return None
    if request.session_id is not None and request.session_id != session_id:
        _say_once(f"halt-session:{request.session_id}",
                  f"ignoring {path}: it is for session {request.session_id}, this rank is in {session_id}")
        return None
    return request


def read_snapshot_request(data: bytes, path: Path, session_id: str, started_ns: int) -> MemorySnapshotRequest | None:
    try:
        request = parse_memory_snapshot_request(data, path)
    except ValueError as exc:
        _say_once(f"mem:{data[:64]!r}", f"ignoring {path}: {exc}")
        return None
    if request.session_id is not None and request.session_id != session_id:
        return None
    if request.requested_at * 1e9 < started_ns - 5e9:
        return None  # made before this rank started: another run's in a reused directory
    return request


# -- CUDA memory snapshots ---------------------------------------------------------------------------


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda") or not hasattr(torch, "optim"):
        return None
    return torch


def cuda_in_use() -> bool:
    """The program has initialised CUDA (never initialises it)."""
    torch = _torch()
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def record_memory_history(max_entries: int = 100_000) -> bool:
    """Turns on the CUDA caching allocator's history (stack traces of each allocation) where CUDA
    is available; False where it is not."""
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries)  # noqa: SLF001 - torch's documented way
    return True


def dump_cuda_snapshot(path: Path) -> None:
    """The one call that writes a CUDA memory snapshot (a pickle ``torch.cuda.memory._snapshot``
    format; open it at https://pytorch.org/memory_viz)."""
    torch = _torch()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))  # noqa: SLF001 - torch's documented way


def answer_memory_snapshot(run_dir: Path, name: str, rank: int, request: MemorySnapshotRequest, *,
                           history: bool) -> dict[str, Any]:
    """Answers one request: a snapshot file where CUDA is in use, else a note saying why not.
    The answer goes into ``<run>/memory_snapshots/<name>.answers.jsonl`` (and is returned, for
    the heartbeat)."""
    now = time.time()
    answer: dict[str, Any] = {"request_id": request.request_id, "rank": rank, "name": name, "ts": round(now, 6),
                              "reason": request.reason}
    if not cuda_in_use():
        answer.update(status="no_cuda", note="this rank does not use CUDA: no memory snapshot (nothing written)")
    else:
        path = run_dir / MEMORY_SNAPSHOTS_DIR / f"{name}-{int(now)}.pickle"
        serial = 1
        while path.exists():
            path = path.with_name(f"{name}-{int(now)}-{serial}.pickle")
            serial += 1
        try:
            dump_cuda_snapshot(path)
        except Exception as exc:  # noqa: BLE001 - said in the answer; the training goes on
            answer.update(status="failed", note=f"{type(exc).__name__}: {exc}"[:500])
        else:
            answer.update(status="written", path=str(path.relative_to(run_dir)), history=history)
            if not history:
                answer["note"] = ("memory history was not recorded (stepwatch.init(memory_history=True) or "
                                  f"{MEMORY_HISTORY_ENV}=1): the snapshot has segments, no allocation stacks")
    answers = run_dir / MEMORY_SNAPSHOTS_DIR / f"{name}.answers.jsonl"
    answers.parent.mkdir(parents=True, exist_ok=True)
    with open(answers, "ab") as file:
        file.write(msgspec.json.encode(answer) + b"\n")
    return answer


def memory_history_from_env(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    return (os.environ if env is None else env).get(MEMORY_HISTORY_ENV, "").strip().lower() not in _OFF

