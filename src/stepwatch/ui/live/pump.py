"""The training's output through a pseudo-terminal of the launcher's own (``OutputPump``): the job
still sees a terminal (colours, progress bars), and its whole lines reach the view to be printed
above it in batches, so the view never tears a line and a job printing fast never waits on it."""

from __future__ import annotations

import codecs
import os
import select
import threading
import time
from collections.abc import Callable

__all__ = ["OutputPump", "copy_window_size"]


class OutputPump:
    """A pseudo-terminal for the training's output: the job writes to its slave side (and sees a
    terminal, of the launcher terminal's size); a thread reads the master side and hands the
    whole lines to ``emit``, a batch at most every ``BATCH_S`` (one redraw of the view a batch,
    however fast the job writes: the pump keeps up, so the job never waits on a full terminal
    buffer); a carriage return keeps what follows it, as a terminal shows it. ``partial`` is the
    line being written (a progress bar redrawn with ``\\r``)."""

    BATCH_S = 0.05

    def __init__(self, emit: Callable[[list[str]], None], *, size_from: int | None = None) -> None:
        self.emit = emit
        self.master, self.slave = os.openpty()
        self.partial = ""
        self.lines = 0
        self._buffer = ""
        self._pending: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = threading.Event()
        self._slave_closed = False
        if size_from is not None:
            copy_window_size(size_from, self.slave)
        self._thread = threading.Thread(target=self._run, name="stepwatch-output-pump", daemon=True)
        self._thread.start()

    def job_started(self) -> None:
        """The job holds the slave now: ours closes, so the master reads end of file once the job's
        last process closes it."""
        if not self._slave_closed:
            self._slave_closed = True
            os.close(self.slave)

    def _run(self) -> None:
        emitted = time.monotonic()
        while True:
            try:
                ready, _, _ = select.select([self.master], [], [], self.BATCH_S)
            except (OSError, ValueError):
                break
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: every writer closed the slave
                    break
                if not data:
                    break
                self._feed(self._decoder.decode(data))
            elif self._stop.is_set():
                break
            if self._pending and (not ready or time.monotonic() - emitted >= self.BATCH_S):
                self._emit()
                emitted = time.monotonic()
        self._feed(self._decoder.decode(b"", final=True))
        if self._buffer:
            self._pending.append(_shown(self._buffer))
            self._buffer = ""
        self._emit()
        self.partial = ""

    def _feed(self, text: str) -> None:
        if not text:
            return
        buffer = self._buffer + text
        *lines, buffer = buffer.split("\n")
        self._pending.extend(_shown(line) for line in lines)
        self._buffer = buffer
        self.partial = _shown(buffer)

    def _emit(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self.lines += len(batch)
        try:
            self.emit(batch)
        except Exception:  # noqa: BLE001 - lines that cannot be drawn must not stop the job's output
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Reads what is left (at most ``timeout`` seconds: a process the job left behind may hold
        the slave), then closes the master."""
        self.job_started()
        self._stop.set()
        self._thread.join(timeout)
        try:
            os.close(self.master)
        except OSError:
            pass


def _shown(line: str) -> str:
    """What a terminal shows of a line: the text after its last carriage return."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def copy_window_size(source: int, target: int) -> None:
    """Gives the terminal ``target`` the size of the terminal ``source`` (neither a terminal: nothing)."""
    try:
        import fcntl
        import termios

        size = fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(target, termios.TIOCSWINSZ, size)
    except (OSError, ImportError):
        pass
