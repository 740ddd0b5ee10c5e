"""A job dies with its launcher: the parent-death signal (Linux), and telling a dead launcher
from a live one.

``stepwatch run`` starts the aggregator, torchrun and the ranks. Killed from outside (``kill -9``,
its terminal closing), it cannot clean up after them; the kernel can. ``PR_SET_PDEATHSIG`` asks
it to send a signal to a process as soon as its parent dies, so each process the launcher
starts (and each rank, whose parent is torchrun) gets SIGTERM and ends as it would on Ctrl-C.
Elsewhere than Linux this does nothing; the launcher's process group still lets a caller kill
the whole job at once.

No torch, no psutil: used by the launcher's children between fork and exec, and by every rank.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCHER_PID_ENV", "die_with_parent", "launcher_gone", "process_gone"]

LAUNCHER_PID_ENV = "STEPWATCH_LAUNCHER_PID"  # set by ``stepwatch run`` for everything it starts
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Asks the kernel for ``signum`` when this process's parent (thread) dies; True if set."""
    prctl = _prctl()
    if prctl is None:
        return False
    try:
        return int(prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, ValueError, TypeError):
        return False


def preexec_die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for the launcher's children (their parent is the launcher itself), or
    None where there is no parent-death signal. libc is loaded here, before the fork: between
    fork and exec the child only makes the call."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return preexec


def _prctl() -> Any:
    global _PRCTL
    if _PRCTL is False:
        _PRCTL = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):
                _PRCTL = None
    return _PRCTL


_PRCTL: Any = False  # not looked up yet


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie its parent has not reaped yet
    (a launcher killed by SIGKILL stays one until its shell collects it)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here (macOS): ask the process table
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    # "pid (comm) S ...": the state follows the last ')' (comm may hold spaces and parens)
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"Z", b"X", b"x")


def launcher_gone() -> int | None:
    """The pid of this job's ``stepwatch run`` if it has died, else None (alive, or not run by it)."""
    try:
        pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        return None
    return pid if pid > 0 and process_gone(pid) else None
