"""The view ``stepwatch run`` shows while the job trains (``RunView``, the launcher's ``JobView``):
on a terminal the rich live view, redrawn on a thread of its own, with the job's output carried
through an ``OutputPump`` to scroll above it; elsewhere one plain line every ``plain_every_s``,
and one last line once the run's summary is written, so even a run shorter than the period
leaves its final figures and verdict in the log."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...views.live import LiveReader, LiveSnapshot
from .pump import OutputPump, copy_window_size
from .table import REFRESH_S, render_view
from .text import PLAIN_EVERY_S, print_plain

__all__ = ["RunView"]


class RunView:
    """The view ``stepwatch run`` shows while the job trains (the launcher calls ``begin``,
    ``streams``, ``job_started`` and ``end``; ``print`` is its echo; ``run`` calls ``finish``
    once the summary is written).

    ``live``: a rich ``Live`` on ``console`` (a terminal), the job's output through an
    ``OutputPump``; else one ``plain_line`` every ``plain_every_s`` through ``console``."""

    def __init__(self, console: Any, *, live: bool, refresh_s: float = REFRESH_S,
                 plain_every_s: float = PLAIN_EVERY_S) -> None:
        self.console = console
        self.live_mode = live
        self.refresh_s = refresh_s
        self.plain_every_s = plain_every_s
        self.reader: LiveReader | None = None
        self.pump: OutputPump | None = None
        self.refreshes = 0
        self.refresh_seconds = 0.0  # CPU the refreshes cost this process (thread time)
        self.errors = 0  # refreshes that failed (the next one tries again)
        self._live: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._restore: Callable[[], Any] | None = None

    # -- the launcher's side -------------------------------------------------------------------

    def begin(self, run_dir: Path, session_id: str) -> None:
        self.reader = LiveReader(run_dir, session_id)
        if self.live_mode:
            from rich.live import Live

            empty = LiveSnapshot(run_dir=str(run_dir), session_id=None, taken_at=time.time())
            self._live = Live(render_view(empty), console=self.console,
                              auto_refresh=False, redirect_stdout=True, redirect_stderr=True, transient=False)
            self._live.start()
            self.pump = OutputPump(self._job_lines, size_from=_fileno(self.console.file))
            self._follow_resizes()
        self._thread = threading.Thread(target=self._run, name="stepwatch-live-view", daemon=True)
        self._thread.start()

    def _follow_resizes(self) -> None:
        """A resized terminal resizes the job's (SIGWINCH, from the main thread only)."""
        import signal

        source, pump = _fileno(self.console.file), self.pump
        if source is None or pump is None or threading.current_thread() is not threading.main_thread():
            return

        def resized(signum: int, frame: Any) -> None:
            copy_window_size(source, pump.master)
            if callable(previous):
                previous(signum, frame)

        try:
            previous = signal.signal(signal.SIGWINCH, resized)
        except (ValueError, OSError, AttributeError):
            return
        self._restore = lambda: signal.signal(signal.SIGWINCH, previous)

    def streams(self) -> tuple[int | None, int | None]:
        """The job's stdout and stderr: the pump's terminal where each is ours (None: inherited)."""
        if self.pump is None:
            return None, None
        return (self.pump.slave if _isatty(sys.__stdout__) else None,
                self.pump.slave if _isatty(sys.__stderr__) else None)

    def job_started(self) -> None:
        if self.pump is not None:
            self.pump.job_started()

    def end(self) -> None:
        """The job has ended: its last output, the last frame, and the terminal back as it was."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._restore is not None:
            self._restore()
            self._restore = None
        if self.pump is not None:
            self.pump.close()
        if self._live is not None:
            try:
                self._refresh()
            finally:
                self._live.stop()
                self._live = None
        if self.reader is not None:
            self.reader.close()

    def finish(self) -> None:
        """The run is over and its summary written: in plain mode, one last line (the final step,
        rate, step time and the diagnosis's primary verdict). The live view drew its last frame
        at ``end``. Never raises: the run's exit code is what matters now."""
        if self.live_mode or self.reader is None:
            return
        try:
            self._refresh()
        except Exception:  # noqa: BLE001 - a missing last line must not change the run's outcome
            self.errors += 1
        finally:
            self.reader.close()

    def print(self, line: str) -> None:
        """One of stepwatch's own lines (``run``'s echo): above the view while it shows."""
        from rich.text import Text

        live = self._live
        (live.console if live is not None else self.console).print(Text(line), soft_wrap=live is None)

    # -- the refresher -------------------------------------------------------------------------

    def _job_lines(self, lines: list[str]) -> None:
        """A batch of the job's lines, above the view: one print, one redraw. The lines go out as
        the job wrote them (its colours kept), not parsed nor wrapped by rich: the terminal wraps
        them, above the view, and the pump keeps up with a job printing tens of thousands a second."""
        live = self._live
        if live is not None:
            live.console.print(_RawLines(lines))

    def _run(self) -> None:
        period = self.refresh_s if self.live_mode else self.plain_every_s
        while not self._stop.wait(period):
            try:
                self._refresh()
            except Exception:  # noqa: BLE001 - the view must never end the run: counted, tried again
                self.errors += 1

    def _refresh(self) -> None:
        if self.reader is None:
            return
        with self._lock:
            started = time.thread_time()
            snapshot = self.reader.snapshot()
            if self._live is not None:
                pending = self.pump.partial if self.pump is not None else None
                self._live.update(render_view(snapshot, pending=pending), refresh=True)
            elif not self.live_mode:
                print_plain(self.console, snapshot)
            self.refreshes += 1
            self.refresh_seconds += time.thread_time() - started


class _RawLines:
    """Lines for a rich console as they are: one segment and a newline each (rich's ``Text``
    would decode, measure and wrap each one, a hundred times the cost)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.segment import Segment

        newline = Segment.line()
        for line in self.lines:
            yield Segment(line + "\x1b[0m" if "\x1b" in line else line)  # a colour left open ends with its line
            yield newline


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
