"""The watchdog's cost in the aggregator (docs/watchdog.md): the intake path with and without
it (it only keeps a reference to each frame's rows there), and one check over everything fed.

Usage::

    PYTHONPATH=src .venv/bin/python bench/bench_watchdog.py [--ranks 64] [--frames 20] [--steps 20]

In-process, no sockets and no store: the same pre-encoded frames as ``bench_ingest.py``'s tcp
phase (per step: 3 telemetry rows, 5 spans, a ``loss`` mark; a heartbeat per frame) through
``Aggregator.accept_body``, best of 5 each way, then ``Watchdog.tick`` over all of it (what the
checks of a second do with that second's rows, on a worker thread).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ingest

from stepwatch.analysis.alerts import AlertPolicy
from stepwatch.schema import new_session_id
from stepwatch.server.aggregator import Aggregator
from stepwatch.server.watchdog import Watchdog
from stepwatch.transport.frames import FrameDecoder


class _NullStore:
    def upsert_session(self, row: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--frames", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sid = new_session_id()
    base = bench_ingest._base_events(sid)
    bodies: list[bytes] = []
    for rank in range(args.ranks):
        frames, _ = bench_ingest.tcp_frames(rank, args.frames, args.steps, sid, args.ranks, base, time.time_ns())
        for frame in frames:
            bodies.extend(FrameDecoder(1 << 26).feed(frame))

    def intake(with_dog: bool) -> tuple[float, int, Watchdog | None]:
        best, rows, dog = float("inf"), 0, None
        for _ in range(5):
            dog = Watchdog(Path(tempfile.mkdtemp()), AlertPolicy(), dump_stacks=False,
                           check_processes=False) if with_dog else None
            aggregator = Aggregator(_NullStore(), watchdog=dog, flush_rows=10**9, pause_rows=10**9,  # type: ignore[arg-type]
                                    max_pending_rows=10**9)
            started = time.perf_counter()
            for body in bodies:
                aggregator.accept_body(body)
            best, rows = min(best, time.perf_counter() - started), aggregator.rows_accepted
        return best, rows, dog

    without, rows, _ = intake(False)
    with_dog, _, dog = intake(True)
    assert dog is not None
    started = time.perf_counter()
    dog.tick()
    check = time.perf_counter() - started
    print(f"{len(bodies)} frames, {rows} rows, {args.ranks * args.frames * args.steps} steps")
    print(f"intake without the watchdog {without * 1e3:.1f} ms, with it {with_dog * 1e3:.1f} ms "
          f"({(with_dog - without) / len(bodies) * 1e6:+.2f} us a frame)")
    feed = Watchdog(Path(tempfile.mkdtemp()), dump_stacks=False, check_processes=False)
    frame = {"telemetry": [()] * 60, "spans": [()] * 100, "marks": [()] * 20, "heartbeats": [()], "steps": [()] * 20}
    started = time.perf_counter()
    for _ in range(100_000):
        feed.feed(sid, 0, "host", frame)
    print(f"the feed alone (what the intake path pays): {(time.perf_counter() - started) * 10:.2f} us a frame")
    print(f"one check of all of it: {check * 1e3:.1f} ms ({check / rows * 1e6:.2f} us a row)")


if __name__ == "__main__":
    main()
