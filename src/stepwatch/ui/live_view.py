"""The live terminal view: ``views.live``'s snapshot drawn with rich (a table of ranks, a progress
bar, the primary verdict and the latest alerts), or, where the output is no terminal, one plain
line every 10 s (``plain_line``: no escape codes at all).

``RunView`` is what ``stepwatch run`` hands the launcher: it redraws about once a second on a
thread of its own and, on a terminal, carries the training's output through a pseudo-terminal
of its own (``OutputPump``) so the program's lines scroll above the view, never torn by it, while
the program still sees a terminal (colours, progress bars). ``watch_run`` is ``stepwatch top``.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..views.live import FOLD_ABOVE, SHARE_NAMES, LiveReader, LiveSnapshot, RankLive, fold_ranks, named_ranks
from .format import fmt_bytes

__all__ = ["PLAIN_EVERY_S", "REFRESH_S", "OutputPump", "RunView", "plain_line", "render_view", "watch_run"]

REFRESH_S = 1.0  # the live view's redraw period
PLAIN_EVERY_S = 10.0  # the plain line's period (no terminal)
BAR_WIDTH = 16  # characters of a rank's phase bar
# a colour a phase, in stepwatch.phases' order (the residual, wait, last and grey)
_PHASE_STYLE = dict(zip(SHARE_NAMES, ("red", "magenta", "green", "blue", "yellow", "cyan", "bright_black"), strict=False))
_SEVERITY_STYLE = {"crit": "bold red", "critical": "bold red", "warn": "yellow", "warning": "yellow",
                   "info": "cyan", "ok": "green"}


# -- formatting ------------------------------------------------------------------------------


def fmt_seconds(value: float | None) -> str:
    """A step time: ms below a second, else seconds."""
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.3g} s"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def verdict_text(verdict: dict[str, Any] | None, *, message: bool = False) -> str:
    """``NAME (severity, rank 3)``, and its message with ``message``; ``no verdict yet``."""
    if not verdict or not verdict.get("name"):
        return "no verdict yet"
    ranks = [str(r) for r in verdict.get("ranks") or ()]
    who = _who(ranks, ", ")
    text = f"{verdict['name']} ({verdict.get('severity') or '?'}{who})"
    if message and verdict.get("message"):
        text += f": {verdict['message']}"
    return text


def plain_line(snapshot: LiveSnapshot) -> str:
    """``[stepwatch] step N (of M) · X steps/s · step time T · <primary verdict>``: one line with
    no escape codes, for a log (the snapshot's text is stripped of control characters)."""
    step = snapshot.step
    parts = [f"[stepwatch] step {step if step is not None else '-'}"
             + (f" (of {snapshot.total_steps})" if snapshot.total_steps else "")]
    parts.append(f"{fmt_rate(snapshot.steps_per_s)} steps/s")
    parts.append(f"step time {fmt_seconds(snapshot.step_time_s)}")
    parts.append(verdict_text(snapshot.verdict))
    if snapshot.alerts:
        last = snapshot.alerts[-1]
        parts.append(f"alert {last.get('kind')}" + _ranks_suffix(last.get("ranks")))
    return _printable(" · ".join(parts))


def _printable(text: str) -> str:
    """Without control characters (an escape code in a verdict's message would reach the log)."""
    return "".join(ch if ch.isprintable() else " " for ch in text)


def _ranks_suffix(ranks: Any) -> str:
    who = _who([str(r) for r in ranks or ()], "")
    return f" ({who})" if who else ""


def _who(ranks: list[str], lead: str) -> str:
    """``rank 3``, ``ranks 1, 5``; past 6 ranks, their count (``40 ranks``): one line stays one line."""
    if not ranks:
        return ""
    if len(ranks) > 6:
        return f"{lead}{len(ranks)} ranks"
    return f"{lead}rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def phase_bar(shares: dict[str, float], width: int = BAR_WIDTH) -> Any:
    """The phases' shares as one bar of ``width`` cells, a colour a phase (largest remainders
    decide the last cells, so the cells always add up to ``width``)."""
    from rich.text import Text

    bar = Text()
    total = sum(max(0.0, shares.get(name, 0.0)) for name in SHARE_NAMES)
    if total <= 0:
        return Text("·" * width, style="bright_black")
    exact = [(name, max(0.0, shares.get(name, 0.0)) / total * width) for name in SHARE_NAMES]
    cells = {name: int(value) for name, value in exact}
    rest = width - sum(cells.values())
    for name, _ in sorted(exact, key=lambda item: item[1] - int(item[1]), reverse=True)[:rest]:
        cells[name] += 1
    for name in SHARE_NAMES:
        if cells[name]:
            bar.append("█" * cells[name], style=_PHASE_STYLE.get(name, "white"))
    return bar


def _top_phase(shares: dict[str, float]) -> str:
    if not shares:
        return ""
    name, share = max(shares.items(), key=lambda item: item[1])
    return f"{name} {share * 100:.0f}%"


def _age(rank: RankLive) -> Any:
    from rich.text import Text

    if rank.state == "stopped":
        return Text("stopped", style="bright_black")
    if rank.state == "lost":
        return Text("lost", style="bold red")
    if rank.heartbeat_age_s is None:
        return Text("-")
    text = f"{rank.heartbeat_age_s:.0f} s" if rank.heartbeat_age_s >= 1.5 else "now"
    return Text(text, style="bold red" if rank.state == "silent" else "")


def render_view(snapshot: LiveSnapshot, *, pending: str | None = None) -> Any:
    """The whole view as one rich renderable."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    if pending:
        parts.append(Text.from_ansi(pending, no_wrap=True, overflow="ellipsis"))
    header = Text("stepwatch ", style="bold")
    header.append(f"{snapshot.run_dir}", style="cyan")
    if snapshot.session_id:
        header.append(f"  session {snapshot.session_id[:8]}")
    header.append(f"  {len(snapshot.ranks)} rank{'s' if len(snapshot.ranks) != 1 else ''}")
    if snapshot.elapsed_s is not None:
        header.append(f"  {_elapsed(snapshot.elapsed_s)}")
    if snapshot.ended:
        header.append("  ended", style="bold")
    parts.append(header)

    named = named_ranks(snapshot)
    shown = fold_ranks(snapshot.ranks, named)
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for column, justify in (("rank", "right"), ("step", "right"), ("step time", "right"), ("steps/s", "right"),
                            ("phases", "left"), ("", "left"), ("memory", "right"), ("peak", "right"),
                            ("heartbeat", "right")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for rank in shown:
        memory = fmt_bytes(rank.memory_bytes) + (f" {rank.memory_kind}" if rank.memory_kind else "")
        label = Text(str(rank.rank), style="bold red" if rank.rank in named else "")
        table.add_row(label, "-" if rank.step is None else str(rank.step), fmt_seconds(rank.step_time_s),
                      fmt_rate(rank.steps_per_s), phase_bar(rank.phase_shares), _top_phase(rank.phase_shares),
                      memory, fmt_bytes(rank.memory_peak_bytes), _age(rank))
    if not shown:
        parts.append(Text("waiting for the ranks' first step...", style="bright_black"))
    else:
        parts.append(table)
        legend = Text("phases: ", style="bright_black")
        for name in SHARE_NAMES:
            legend.append("█", style=_PHASE_STYLE.get(name, "white"))
            legend.append(f" {name}  ", style="bright_black")
        parts.append(legend)
    if len(shown) < len(snapshot.ranks):
        parts.append(Text(f"{len(shown)} of {len(snapshot.ranks)} ranks shown (more than {FOLD_ABOVE}): the "
                          "slowest, the fastest and the median rank, and every rank a verdict or alert names",
                          style="bright_black"))

    step, total = snapshot.step, snapshot.total_steps
    if total:
        done = min(step or 0, total)
        line = Table.grid(padding=(0, 1))
        line.add_row(ProgressBar(total=total, completed=done, width=40),
                     Text(f"step {step or 0} of {total} ({done / total * 100:.0f}%)" + _eta(snapshot)))
        parts.append(line)
    elif step is not None:
        parts.append(Text(f"step {step} (total unknown)", style="bright_black"))

    verdict = Text("verdict ", style="bold")
    if snapshot.verdict:
        style = _SEVERITY_STYLE.get(str(snapshot.verdict.get("severity")), "")
        verdict.append(verdict_text(snapshot.verdict), style=style)
        if snapshot.verdict.get("message"):
            verdict.append(f": {snapshot.verdict['message']}")
    else:
        verdict.append("none yet", style="bright_black")
    parts.append(verdict)
    for alert in snapshot.alerts[-3:]:
        line_ = Text("alert ", style="bold red")
        line_.append(f"{alert.get('kind')} ({alert.get('severity') or '?'})" + _ranks_suffix(alert.get("ranks")),
                     style=_SEVERITY_STYLE.get(str(alert.get("severity")), ""))
        if alert.get("step") is not None:
            line_.append(f" step {alert['step']}")
        if alert.get("message"):
            line_.append(f": {alert['message']}")
        parts.append(line_)
    return Group(*parts)


def _elapsed(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _eta(snapshot: LiveSnapshot) -> str:
    step, total, rate = snapshot.step, snapshot.total_steps, snapshot.steps_per_s
    if not total or step is None or not rate or step >= total or snapshot.ended:
        return ""
    return f", about {_elapsed((total - step) / rate)} left"


# -- the training's output through a pseudo-terminal ------------------------------------------


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
            _copy_window_size(size_from, self.slave)
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


def _copy_window_size(source: int, target: int) -> None:
    try:
        import fcntl
        import termios

        size = fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(target, termios.TIOCSWINSZ, size)
    except (OSError, ImportError):
        pass


# -- stepwatch run ----------------------------------------------------------------------------


class RunView:
    """The view ``stepwatch run`` shows while the job trains (the launcher calls ``begin``,
    ``streams``, ``job_started`` and ``end``; ``print`` is its echo).

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
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._restore: Callable[[], Any] | None = None

    # -- the launcher's side -------------------------------------------------------------------

    def begin(self, run_dir: Path, session_id: str) -> None:
        self.reader = LiveReader(run_dir, session_id)
        self._started = time.time()
        if self.live_mode:
            from rich.live import Live

            self._live = Live(render_view(self._empty()), console=self.console,
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
            _copy_window_size(source, pump.master)
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

    def print(self, line: str) -> None:
        """One of stepwatch's own lines (``run``'s echo): above the view while it shows."""
        from rich.text import Text

        live = self._live
        (live.console if live is not None else self.console).print(Text(line), soft_wrap=live is None)

    # -- the refresher -------------------------------------------------------------------------

    def _empty(self) -> LiveSnapshot:
        return LiveSnapshot(run_dir=str(self.reader.run_dir) if self.reader else "", session_id=None,
                            taken_at=time.time())

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
                self.console.print(plain_line(snapshot), markup=False, highlight=False, soft_wrap=True)
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


# -- stepwatch top -----------------------------------------------------------------------------


def watch_run(run_dir: Path, console: Any, *, session_id: str | None = None, live: bool, once: bool = False,
              refresh_s: float = REFRESH_S, plain_every_s: float = PLAIN_EVERY_S,
              clock: Callable[[], float] = time.time) -> LiveSnapshot:
    """``stepwatch top``: the view of ``run_dir`` until its run has ended (or Ctrl-C, which the
    caller takes); the last snapshot. ``once``: one frame and return."""
    reader = LiveReader(run_dir, session_id, clock=clock)
    try:
        snapshot = reader.snapshot()
        if once:
            console.print(render_view(snapshot))
            return snapshot
        if not live:
            console.print(plain_line(snapshot), markup=False, highlight=False, soft_wrap=True)
            while not snapshot.ended:
                time.sleep(plain_every_s)
                snapshot = reader.snapshot()
                console.print(plain_line(snapshot), markup=False, highlight=False, soft_wrap=True)
            return snapshot
        from rich.live import Live

        with Live(render_view(snapshot), console=console, auto_refresh=False) as view:
            while not snapshot.ended:
                time.sleep(refresh_s)
                snapshot = reader.snapshot()
                view.update(render_view(snapshot), refresh=True)
        return snapshot
    finally:
        reader.close()
