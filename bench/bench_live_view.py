"""The live terminal view's cost in the launcher process (docs/live-view.md): CPU per refresh, so
CPU per second at its one refresh a second, for 1 to 256 ranks.

Usage::

    PYTHONPATH=src .venv/bin/python bench/bench_live_view.py [--ranks 1,8,64,256] [--refreshes 20] [--real 2]

A run directory in the files the ranks write: per rank a step ledger (``StepLedger``, the
writer the ranks use, its ring full: 4,096 steps), a telemetry segment with an hour of memory
samples (3,600 lines) and a heartbeat file; an alerts.jsonl. Before each refresh every rank
gains what a second of training at 100 steps/s adds (100 ledger records, one memory sample).
Measured on this thread (``time.thread_time``): the ``LiveReader.snapshot`` (reading what is
new), the rich table drawn to a terminal console (``render_view``, what ``Live`` refreshes),
and the plain line. The first snapshot (it reads the hour of samples a ``top`` started late
finds) is reported apart. Median of ``--refreshes``. Then the lines a second a job can print
through the view's pseudo-terminal while the view shows (100,000 lines from a writer thread).

``--real N``: then the launcher process itself, N times each way in turn: ``stepwatch run`` of
examples/train_demo.py (``--steps 3000``, one rank) under a pseudo-terminal with ``--view live``
and with ``--view off``; the launcher's own CPU time (``psutil``, its children not counted, read
until it exits) over its wall time.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stepwatch.artifacts.heartbeat import HeartbeatWriter, heartbeat_record
from stepwatch.artifacts.step_ledger import StepLedger
from stepwatch.ui.live.table import render_view
from stepwatch.ui.live.text import plain_line
from stepwatch.views.live import LiveReader

SESSION = "5b0c8f4e-3a1d-4c2b-9e7f-0123456789ab"
STEPS_PER_S = 100
SAMPLE = {"schema_version": 3, "session_id": SESSION, "event_type": "sample", "collector": "stepwatch.cpu_tracker",
          "sampling_interval_ms": 1000, "pid": 1, "host": "bench", "device_id": -1, "allocator_reserved_bytes": 1,
          "context": None, "metadata": {"backend": "cpu", "sampling_source": "psutil"}}


class Rank:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.ledger = StepLedger.create(run_dir, SESSION, rank=rank, started_ns=time.time_ns())
        self.segment = run_dir / "telemetry" / f"rank{rank}" / "segment-000001.jsonl"
        self.segment.parent.mkdir(parents=True, exist_ok=True)
        self.step = 0
        heartbeat = HeartbeatWriter(run_dir, rank)
        heartbeat.write(heartbeat_record(ts=time.time(), pid=1, rank=rank, step=0, msg="boot", session_id=SESSION))
        heartbeat.close()

    def second(self, steps: int, now_ns: int) -> None:
        """What one second of training adds: ``steps`` ledger records, one memory sample."""
        phases = {"forward": 3_000_000, "backward": 4_000_000, "optimizer_step": 1_000_000, "data_load": 500_000}
        start = now_ns - steps * 10_000_000
        for i in range(steps):
            begin = start + i * 10_000_000
            self.ledger.write(self.step, begin, begin + 9_000_000, phases)
            self.step += 1
        self.ledger.alive(now_ns)
        with self.segment.open("ab") as handle:
            handle.write((json.dumps({**SAMPLE, "timestamp_ns": now_ns,
                                      "allocator_allocated_bytes": 2**30 + self.step}) + "\n").encode())

    def hour_of_samples(self, now_ns: int) -> None:
        lines = [json.dumps({**SAMPLE, "timestamp_ns": now_ns - (3600 - i) * 10**9,
                             "allocator_allocated_bytes": 2**30 + i}) for i in range(3600)]
        self.segment.write_bytes(("\n".join(lines) + "\n").encode())


def measure(ranks: int, refreshes: int) -> dict[str, float]:
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "run.json").write_text(json.dumps({"session_id": SESSION, "world_size": ranks,
                                                      "started_at_ns": time.time_ns(), "launcher": "run"}))
        writers = [Rank(run_dir, r) for r in range(ranks)]
        now = time.time_ns()
        for writer in writers:
            writer.hour_of_samples(now)
            writer.second(4096, now)  # a full ring
        console = Console(file=io.StringIO(), force_terminal=True, width=160, color_system="truecolor")
        reader = LiveReader(run_dir, SESSION)
        started = time.thread_time()
        reader.snapshot()
        first = time.thread_time() - started
        reads, draws, plains = [], [], []
        for _ in range(refreshes):
            now = time.time_ns()
            for writer in writers:
                writer.second(STEPS_PER_S, now)
            started = time.thread_time()
            snapshot = reader.snapshot()
            read = time.thread_time()
            console.print(render_view(snapshot))
            drawn = time.thread_time()
            plain_line(snapshot)
            plains.append(time.thread_time() - drawn)
            reads.append(read - started)
            draws.append(drawn - read)
            console.file.seek(0)
            console.file.truncate()
        reader.close()
        for writer in writers:
            writer.ledger.close(time.time_ns())
    read, draw = statistics.median(reads), statistics.median(draws)
    return {"ranks": ranks, "first_ms": first * 1e3, "read_ms": read * 1e3, "draw_ms": draw * 1e3,
            "plain_ms": statistics.median(plains) * 1e3, "cpu_pct": (read + draw) * 100}


def launcher_cpu(view: str, steps: int) -> tuple[float, float]:
    """(CPU seconds of the launcher process alone, its wall seconds) for one ``stepwatch run``
    on a pseudo-terminal."""
    import os
    import pty
    import select

    import psutil

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "stepwatch", "run", "--view", view, "--out", f"{tmp}/run",
                str(repo / "examples" / "train_demo.py"), "--steps", str(steps)]
        started = time.monotonic()
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(sys.executable, argv)
        process = psutil.Process(pid)
        cpu = 0.0
        while True:
            try:
                times = process.cpu_times()
                cpu = times.user + times.system
            except psutil.NoSuchProcess:
                break
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    if not os.read(fd, 65536):
                        break
                except OSError:
                    break
        os.waitpid(pid, 0)
        os.close(fd)
        return cpu, time.monotonic() - started


def pump_rate(lines: int) -> float:
    """Lines a second a job can print through the live view's pseudo-terminal while the view
    shows (a writer thread, one ``write`` a line; the view drawn to /dev/null as a terminal)."""
    import os
    import threading

    from rich.console import Console

    from stepwatch.ui.live.run_view import RunView

    with open(os.devnull, "w") as sink, tempfile.TemporaryDirectory() as tmp:
        view = RunView(Console(file=sink, force_terminal=True, width=140), live=True)
        view.begin(Path(tmp), SESSION)
        assert view.pump is not None
        writer = os.dup(view.pump.slave)
        view.job_started()

        def write() -> None:
            for i in range(lines):
                os.write(writer, f"step {i}: loss 0.1234, lr 3e-4, a line a training loop prints\n".encode())
            os.close(writer)

        started = time.monotonic()
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        elapsed = time.monotonic() - started
        view.end()
    return lines / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="1,8,64,256")
    parser.add_argument("--refreshes", type=int, default=20)
    parser.add_argument("--real", type=int, default=0, help="real runs each way (live, off)")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; {STEPS_PER_S} steps/s per rank; median of {args.refreshes} refreshes")
    print(f"{'ranks':>5}  {'first read':>10}  {'read':>8}  {'draw':>8}  {'plain':>8}  {'CPU at 1/s':>10}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        row = measure(ranks, args.refreshes)
        print(f"{row['ranks']:>5}  {row['first_ms']:>7.1f} ms  {row['read_ms']:>5.2f} ms  {row['draw_ms']:>5.2f} ms  "
              f"{row['plain_ms']:>5.3f} ms  {row['cpu_pct']:>9.2f}%")
    print(f"the job's output through the view's pseudo-terminal: {pump_rate(100_000):,.0f} lines/s")
    if args.real:
        print(f"launcher process, stepwatch run train_demo.py --steps {args.steps} on a pseudo-terminal:")
        found: dict[str, list[tuple[float, float]]] = {"live": [], "off": []}
        for _ in range(args.real):
            for view in ("live", "off"):
                found[view].append(launcher_cpu(view, args.steps))
        for view, runs in found.items():
            cpu = statistics.median(c for c, _ in runs)
            wall = statistics.median(w for _, w in runs)
            print(f"  --view {view:<4}  CPU {cpu:.2f} s over {wall:.1f} s wall ({cpu / wall * 100:.2f}% of a core)")
        extra = statistics.median(c for c, _ in found["live"]) - statistics.median(c for c, _ in found["off"])
        wall = statistics.median(w for _, w in found["live"])
        print(f"  the view: {extra:+.2f} s CPU, {extra / wall * 100:+.2f}% of a core")


if __name__ == "__main__":
    main()
