"""The coherent halt of one rank (docs/halt.md): every rank stops at the same step.

The sampler reads ``.HALT`` at its tick (``poll``); from then on each completed step is compared
with the target (``step_done``, one attribute read a step before any halt is asked for: none).
Once the target step is done, ``stepwatch.halt_requested()`` is true and the training state's
``trap`` is set: the training thread's next phase or step raises ``Halt`` (the loop's own check
after ``optimizer.step()`` comes first). The trap is the one way stepwatch stops training code;
nothing of the training state is replaced to do it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..artifacts.halt import HaltRequest
from .controls import HALT_FILENAME, Halt, RequestFile, halt_exit_code, read_halt_request, training_thread
from .training import TrainingState

__all__ = ["HaltController"]


class HaltController:
    """Owns one rank's halt: the request it follows, the step it stopped at, the thread it
    stops, and whether its caller stops the loop its own way. ``say`` writes a heartbeat record
    (``msg``, fields); ``ended`` rewrites the rank's end file; ``current_step`` is the last step
    completed."""

    def __init__(self, training: TrainingState, *, session_id: str, rank: Callable[[], int],
                 say: Callable[..., None], ended: Callable[[], None], current_step: Callable[[], int]) -> None:
        self.training = training
        self.session_id = session_id
        self._rank = rank
        self._say = say
        self._ended = ended
        self._current_step = current_step
        self.request: HaltRequest | None = None  # the request this rank follows
        self.target: int | None = None  # its target step while it waits for it: read at every step
        self.step: int | None = None  # set (on the training thread) once the target step completed
        self.late = False  # the request came after its target step: stopped at the next boundary
        self.thread: int | None = None  # the thread the halt stops (None: any, for a late halt)
        self.left = False  # the caller stops the loop its own way: no trap (leave_to_caller)
        self._said = False
        self._file: RequestFile | None = None
        self._path: Path | None = None

    def watch(self, run_dir: Path) -> None:
        """Looks for ``.HALT`` in ``run_dir`` from now on (once the rank's artifacts are open)."""
        self._path = run_dir / HALT_FILENAME
        self._file = RequestFile(self._path)

    # -- sampler thread ------------------------------------------------------------------------------

    def poll(self) -> None:
        """A new or changed ``.HALT`` for this session arms the halt; one removed in time cancels it;
        the halt reached is said once."""
        if self.step is not None:
            self._say_reached()
            return
        if self._file is None or self._path is None:
            return
        data = self._file.poll()
        if data is None:
            if not self._file.present and self.request is not None:  # .HALT removed in time: cancelled
                self.request = None
                self.target = None
                self._say("halt_cancelled")
            return
        request = read_halt_request(data, self._path, self.session_id)
        if request is None:
            return
        self.request = request
        step = self._current_step()
        if step >= request.target_step:  # seen too late: stop at the next boundary, and say so
            self.late = True
            self._reach(step, training_thread(self.training))
        else:
            self.target = request.target_step
        self._say("halt_requested", target_step=request.target_step, reason=request.reason,
                  late=self.late or None)
        self._say_reached()

    def _say_reached(self) -> None:
        if self.step is not None and not self._said and self.request is not None:
            self._said = True
            self._say("halt", step=self.step, target_step=self.request.target_step, reason=self.request.reason)

    # -- training thread -----------------------------------------------------------------------------

    def step_done(self, step: int) -> None:
        """A step completed while a halt waits for its target (``target`` not None)."""
        target = self.target
        if target is not None and step >= target:
            self._reach(step, threading.get_ident())

    def _reach(self, step: int, thread: int | None) -> None:
        """The target step is done: ``halt_requested()`` is true from now on, and the trap is set."""
        if self.step is not None:
            return
        self.step = step
        self.thread = thread
        self.target = None
        if not self.left:
            self.training.trap = self.trap
        self._ended()

    def trap(self) -> None:
        """The training state's trap while the halt is pending: raises ``Halt`` on the thread it
        stops (once: a program that catches it goes on)."""
        if self.thread not in (None, threading.get_ident()):
            return
        self.raise_halt()

    def reached_here(self) -> bool:
        """The halt's step is done, and this is the thread it stops (any thread for a late halt)."""
        return self.step is not None and self.thread in (None, threading.get_ident())

    def leave_to_caller(self) -> None:
        """The halt's step is done and the caller stops the loop its own way (a framework's stop
        flag): no ``Halt`` is raised at the next phase. The rank's outcome stays ``halted``."""
        self.left = True
        self._disarm()

    def _disarm(self) -> None:
        if self.training.trap == self.trap:
            self.training.trap = None

    def raise_halt(self) -> None:
        """Raises ``Halt`` for the step reached (once: a program that catches it goes on)."""
        self._disarm()
        request = self.request
        raise Halt(self.step or 0, request.reason if request is not None else "", halt_exit_code())

    def record(self) -> dict[str, Any] | None:
        """The rank's halt, for its end file and run.json (None: not halted)."""
        request = self.request
        if self.step is None or request is None:
            return None
        return {"kind": "halt", "rank": self._rank(), "type": "Halt", "step": self.step,
                "target_step": request.target_step, "late": self.late, "reason": request.reason,
                "requested_at": request.requested_at, "by": request.by, "fatal": False,
                "message": f"halted at step {self.step} on request: {request.reason}",
                "traceback": None, "at_ns": time.time_ns()}
