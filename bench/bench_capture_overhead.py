"""Calling-thread cost of phases and progress, and the cost of one memory sample: stepwatch's
capture runtime against Stormlog 0.4.3's ``CPUMemoryTracker``.

Usage::

    .venv/bin/python bench/bench_capture_overhead.py [--pairs N] [--stormlog-pairs M] [--repeat K]
                                                    [--samples S] [--tmp-dir DIR] [--profile]

``--profile`` adds cProfile listings of stepwatch's phase pairs, samples and drain, and the
drain's cost per pair under three sink policies (where the background time goes).

One fresh subprocess per contender:

  * ``stepwatch-off``: ``import stepwatch`` without ``init`` (phases and progress are no-ops),
    plus the floor of any ``with`` statement: a no-op context manager class;
  * ``stepwatch``: ``stepwatch.init(out=DIR, interval=1.0)``, sampler thread and sink live, as a
    user runs it; also times ``shutdown`` afterwards;
  * ``stepwatch-paused``: the same runtime with its sampler thread stopped right after ``init``,
    so the calling thread runs alone (no GIL contention; the phase table is emptied, untimed,
    between batches, as a sampler that keeps up leaves it); then, single-threaded, the sampling
    side: ``runtime._sample(time.time())`` per call, its parts, a forced ``tick()``, and the
    background work a phase pair leaves behind (``runtime._drain()`` per pair);
  * ``stormlog`` / ``stormlog-sink``: ``CPUMemoryTracker(sampling_interval=1.0)`` without and
    with ``TelemetrySinkConfig(root_dir=DIR)``, tracking; then, its sampler thread stopped, the
    body of its sampling loop for one unchanged-RSS tick: ``_current_rss()`` +
    ``_add_event("sample", ...)`` + ``_flush_telemetry_sink()``.

Per-pair figures are batch means: time ``N`` pairs (``M`` for Stormlog, which is ~100x slower),
``K`` times after a warm-up and a full collection; the table shows the median and the p99
(nearest rank) of the ``K`` batch means. Sample figures time each call alone. Garbage
collection stays on (it is part of the cost) and its time is reported.
"""

from __future__ import annotations

import argparse
import gc
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    GcTimer,
    load_average,
    machine_header,
    peak_rss_bytes,
    print_header,
    print_table,
    run_worker,
    versions,
    worker_main,
    write_results,
)

SCRIPT = Path(__file__).resolve()
TARGET_PAIR_US = 5.0
WARMUP_BATCHES = 20


# -- timing ------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _summary_ns(per_op_ns: list[float]) -> dict[str, Any]:
    return {
        "median_ns": _percentile(per_op_ns, 50),
        "p99_ns": _percentile(per_op_ns, 99),
        "mean_ns": sum(per_op_ns) / len(per_op_ns),
        "min_ns": min(per_op_ns),
        "max_ns": max(per_op_ns),
    }


def time_batches(
    run_batch: Callable[[int], None], per_batch: int, repeat: int, between: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """``repeat`` batch means of ``run_batch(per_batch)`` in ns per operation, after a warm-up.

    ``between()`` runs before each batch, untimed.
    """
    for _ in range(WARMUP_BATCHES):
        run_batch(per_batch)
    gc.collect()
    per_op: list[float] = []
    clock = time.perf_counter_ns
    with GcTimer() as gc_timer:
        for _ in range(repeat):
            if between is not None:
                between()
            started = clock()
            run_batch(per_batch)
            per_op.append((clock() - started) / per_batch)
    return {
        **_summary_ns(per_op),
        "per_batch": per_batch,
        "batches": repeat,
        "batch_means_ns": per_op,
        "gc_s": gc_timer.seconds,
        "gc_collections": gc_timer.collections,
    }


def time_calls(call: Callable[[], Any], count: int, warmup: int = 20) -> dict[str, Any]:
    """``count`` single calls, each timed alone, in ns."""
    for _ in range(warmup):
        call()
    gc.collect()
    per_call: list[float] = []
    clock = time.perf_counter_ns
    with GcTimer() as gc_timer:
        for _ in range(count):
            started = clock()
            call()
            per_call.append(clock() - started)
    return {**_summary_ns(per_call), "calls": count, "gc_s": gc_timer.seconds,
            "gc_collections": gc_timer.collections}


def _phase_batch(phase: Any, **attrs: Any) -> Callable[[int], None]:
    """The loop a user writes: a fresh ``phase`` object per ``with``."""
    if attrs:
        def run(n: int) -> None:
            for _ in range(n):
                with phase("step", **attrs):
                    pass
    else:
        def run(n: int) -> None:
            for _ in range(n):
                with phase("step"):
                    pass
    return run


def _common_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


# -- workers: stepwatch ------------------------------------------------------------------------


def _stepwatch_off_worker(argv: list[str]) -> dict[str, Any]:
    args = _common_args(argv)
    import stepwatch

    class _NoOp:
        __slots__ = ()

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> bool:
            return False

    def noop_batch(n: int) -> None:
        for _ in range(n):
            with _NoOp():
                pass

    def progress_batch(n: int, progress: Any = stepwatch.progress) -> None:
        for i in range(n):
            progress(i, loss=0.5)

    out = {
        "active": stepwatch.current_runtime().active,
        "noop_with": time_batches(noop_batch, args.pairs, args.repeat),
        "phase_pair": time_batches(_phase_batch(stepwatch.phase), args.pairs, args.repeat),
        "phase_pair_attrs": time_batches(_phase_batch(stepwatch.phase, epoch=3), args.pairs, args.repeat),
        "progress": time_batches(progress_batch, args.pairs, args.repeat),
        "torch_loaded": "torch" in sys.modules,
        "rss_peak_bytes": peak_rss_bytes(),
    }
    return out


def _stepwatch_live_worker(argv: list[str]) -> dict[str, Any]:
    args = _common_args(argv)
    import stepwatch

    runtime = stepwatch.init(out=args.out, interval=1.0)
    if not runtime.active:
        raise SystemExit("stepwatch.init did not start a runtime")

    def progress_batch(n: int, progress: Any = stepwatch.progress) -> None:
        for i in range(n):
            progress(i, loss=0.5)

    out: dict[str, Any] = {}
    out["phase_pair"] = time_batches(_phase_batch(stepwatch.phase), args.pairs, args.repeat)
    out["phase_pair_attrs"] = time_batches(_phase_batch(stepwatch.phase, epoch=3), args.pairs, args.repeat)
    out["progress"] = time_batches(progress_batch, args.pairs, args.repeat)
    # What the sampler thread got through while the calling thread ran flat out.
    out["phase_rows_appended"] = runtime.phase_rows.appended
    out["progress_rows_appended"] = runtime.progress_rows.appended
    out["drops_at_end"] = runtime.drops()
    out["sink_events_written_at_end"] = sum(s.event_count for s in runtime.sink._manifest.segments)
    out["table_rows"] = runtime.config.table_rows
    # Shutdown's worst case: both tables full (the progress series above filled its table).
    run_pairs = _phase_batch(stepwatch.phase)
    run_pairs(runtime.config.table_rows)
    out["phase_rows_appended_at_shutdown"] = runtime.phase_rows.appended
    out["rows_queued_at_shutdown"] = {"phases": len(runtime.phase_rows), "progress": len(runtime.progress_rows)}
    started = time.perf_counter()
    stepwatch.shutdown()
    out["shutdown_s"] = time.perf_counter() - started
    out["rss_peak_bytes"] = peak_rss_bytes()  # before loading the run back below
    # Every phase row appended is on disk, evicted by the bound, or dropped at the stop deadline.
    from stepwatch.telemetry import load_telemetry_sessions

    (session,) = load_telemetry_sessions(args.out)
    out["session_status"] = session.summary.status
    out["phase_records_on_disk"] = sum(e.event_type in ("phase_enter", "phase_exit") for e in session.events)
    out["drops_in_stop_record"] = [e for e in session.events if e.event_type == "stop"][0].metadata["dropped"]
    out["sink_segments_pruned"] = runtime.sink._manifest.pruned_segment_count
    out["torch_loaded"] = "torch" in sys.modules
    return out


def _quiesce(runtime: Any) -> None:
    """Stops the sampler thread without closing the session (``stop`` later finds it stopped)."""
    runtime._stop.set()
    runtime._thread.join()


def _stepwatch_paused_worker(argv: list[str]) -> dict[str, Any]:
    args = _common_args(argv)
    import stepwatch

    runtime = stepwatch.init(out=args.out, interval=1.0)
    if not runtime.active:
        raise SystemExit("stepwatch.init did not start a runtime")
    _quiesce(runtime)
    out: dict[str, Any] = {}
    # Rows are discarded between batches, as a sampler that keeps up would leave the table.
    out["phase_pair"] = time_batches(_phase_batch(stepwatch.phase), args.pairs, args.repeat,
                                     between=runtime.phase_rows.drain)
    runtime.phase_rows.drain()  # the drain cost is timed below on a known count

    # One sample as the sampler takes it: collector read, event build, sink append.
    out["sample"] = time_calls(lambda: runtime._sample(time.time()), args.samples)
    health = runtime.collectors[0]
    out["sample_parts"] = {
        "collector_read": time_calls(health.collector.read, args.samples),
        "health_metadata": time_calls(health.metadata, args.samples),
    }
    reading = health.collector.read()[0]
    meta = health.metadata()
    factory = runtime.factory
    name = health.collector.name
    out["sample_parts"]["event_build"] = time_calls(
        lambda: factory.sample(name, reading, meta, time.time_ns(), primary=True), args.samples)
    event = factory.sample(name, reading, meta, time.time_ns(), primary=True)
    out["sample_parts"]["sink_append"] = time_calls(lambda: runtime.sink.append(event), args.samples)
    out["collectors"] = [h.collector.name for h in runtime.collectors]

    # A whole background tick with its sample forced (drain empty, heartbeat, flush checks).
    def forced_tick() -> None:
        runtime._next_sample = 0.0
        runtime.tick()

    out["tick_forced_sample"] = time_calls(forced_tick, args.samples)

    # Background work one phase pair leaves: two rows to records, encoded, written per policy.
    drain_pairs = 2000
    phase = stepwatch.phase
    drain_per_pair: list[float] = []
    for _ in range(5):
        for _ in range(drain_pairs):
            with phase("step"):
                pass
        gc.collect()
        started = time.perf_counter_ns()
        runtime._drain()
        drain_per_pair.append((time.perf_counter_ns() - started) / drain_pairs)
    out["drain_per_pair"] = {**_summary_ns(drain_per_pair), "pairs_per_drain": drain_pairs,
                             "drains": len(drain_per_pair), "per_drain_ns_per_pair": drain_per_pair,
                             "sink_flush_every_events": runtime.config.sink.flush_every_events,
                             "sink_fsync": runtime.config.sink.fsync}
    stepwatch.shutdown()
    out["torch_loaded"] = "torch" in sys.modules
    out["rss_peak_bytes"] = peak_rss_bytes()
    return out


def _profile_worker(argv: list[str]) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    args = _common_args(argv)
    import stepwatch

    runtime = stepwatch.init(out=args.out, interval=1.0)
    _quiesce(runtime)
    phase = stepwatch.phase
    pairs = runtime.config.table_rows // 2  # as many as the phase table holds: all are drained

    def pairs_loop() -> None:
        for _ in range(pairs):
            with phase("step"):
                pass

    def samples_loop() -> None:
        for _ in range(args.samples):
            runtime._sample(time.time())

    def drain() -> None:
        runtime._drain()

    for label, target in ((f"{pairs:,} phase pairs (calling thread)", pairs_loop),
                          (f"{args.samples:,} x runtime._sample", samples_loop),
                          (f"runtime._drain() of the {pairs:,} pairs above (background thread)", drain)):
        profiler = cProfile.Profile()
        profiler.enable()
        target()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        body = text.getvalue().strip().splitlines()
        keep = [line for line in body if line.strip() and not line.startswith(("Ordered by", "List reduced"))]
        print(f"cProfile of {label}, sorted by own time:")
        for line in keep:
            print("  " + line)
    stepwatch.shutdown()
    return {}


def _drain_configs_worker(argv: list[str]) -> dict[str, Any]:
    """Background cost per phase pair under three sink policies (diagnostic for ``--profile``)."""
    args = _common_args(argv)
    import stepwatch
    from stepwatch.artifacts.sink import SinkConfig

    configs = {
        "runtime's sink (flush every 2000, fsync='close')": None,
        "SinkConfig() defaults (flush every 50, fsync='flush')": SinkConfig(),
        "flush every 50, fsync='never'": SinkConfig(fsync="never"),
    }
    out: dict[str, Any] = {}
    for index, (label, config) in enumerate(configs.items()):
        options = {} if config is None else {"sink": config}
        runtime = stepwatch.init(out=args.out / str(index), interval=1.0, **options)
        _quiesce(runtime)
        per_pair: list[float] = []
        for _ in range(5):
            for _ in range(2000):
                with stepwatch.phase("step"):
                    pass
            gc.collect()
            started = time.perf_counter_ns()
            runtime._drain()
            per_pair.append((time.perf_counter_ns() - started) / 2000)
        stepwatch.shutdown()
        out[label] = _summary_ns(per_pair)
        print(f"runtime._drain() per phase pair, {label}: median {_us(out[label]['median_ns'])} us")
    return out


# -- workers: stormlog -------------------------------------------------------------------------


def _stormlog_worker(argv: list[str], with_sink: bool) -> dict[str, Any]:
    args = _common_args(argv)
    from stormlog.cpu_profiler import CPUMemoryTracker
    from stormlog.telemetry_sink import TelemetrySinkConfig

    config = TelemetrySinkConfig(root_dir=args.out) if with_sink else None
    tracker = CPUMemoryTracker(sampling_interval=1.0, telemetry_sink_config=config)
    tracker.start_tracking()
    out: dict[str, Any] = {}
    out["phase_pair"] = time_batches(_phase_batch(tracker.phase), args.pairs, args.repeat)

    # Its sampler loop's body for a tick whose RSS did not change (stormlog/cpu_profiler.py,
    # CPUMemoryTracker._tracking_loop); a tick where RSS moved adds one or two more events.
    tracker._stop_event.set()
    if tracker._tracking_thread is not None:
        tracker._tracking_thread.join()

    def sample() -> None:
        rss = tracker._current_rss()
        tracker._add_event("sample", 0, "Collected CPU telemetry sample.", rss=rss)
        tracker._flush_telemetry_sink()

    out["sample"] = time_calls(sample, args.samples)
    rss = tracker._current_rss()
    out["sample_parts"] = {
        "collector_read": time_calls(tracker._current_rss, args.samples),
        "event_build_and_sink_append": time_calls(
            lambda: tracker._add_event("sample", 0, "Collected CPU telemetry sample.", rss=rss), args.samples),
    }
    tracker.stop_tracking()
    out["torch_loaded"] = "torch" in sys.modules
    out["rss_peak_bytes"] = peak_rss_bytes()
    return out


WORKERS: dict[str, Callable[[list[str]], dict[str, Any]]] = {
    "stepwatch-off": _stepwatch_off_worker,
    "stepwatch": _stepwatch_live_worker,
    "stepwatch-paused": _stepwatch_paused_worker,
    "stormlog": lambda argv: _stormlog_worker(argv, with_sink=False),
    "stormlog-sink": lambda argv: _stormlog_worker(argv, with_sink=True),
    "profile-stepwatch": _profile_worker,
    "drain-configs": _drain_configs_worker,
}


# -- the parent --------------------------------------------------------------------------------


def _us(ns: float) -> str:
    us = ns / 1000
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000, help="stepwatch pairs per batch (default 1000)")
    parser.add_argument("--stormlog-pairs", type=int, default=100,
                        help="stormlog pairs per batch (default 100; it is ~100x slower per pair)")
    parser.add_argument("--repeat", type=int, default=200, help="batches per series (default 200)")
    parser.add_argument("--samples", type=int, default=1000, help="single sample calls timed (default 1000)")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where run and sink directories are written (default: the temp dir)")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile stepwatch's phase pairs, samples and drain, and time the drain "
                             "under three sink policies")
    args = parser.parse_args()

    header = machine_header(args.tmp_dir)
    header["versions"].update(versions("psutil", "torch"))
    print_header(f"capture overhead: phase pair, progress, one sample; {args.repeat} batches per series",
                 header)
    work = Path(tempfile.mkdtemp(prefix="bench-capture-overhead-", dir=args.tmp_dir))
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in ("stepwatch-off", "stepwatch", "stepwatch-paused", "stormlog", "stormlog-sink"):
            pairs = args.stormlog_pairs if name.startswith("stormlog") else args.pairs
            print(f"running {name} ...", flush=True)
            started = time.perf_counter()
            results[name] = run_worker(SCRIPT, name, [
                "--pairs", str(pairs), "--repeat", str(args.repeat), "--samples", str(args.samples),
                "--out", str(work / name),
            ])
            results[name]["worker_wall_s"] = time.perf_counter() - started
        if args.profile:
            print()
            diagnostic_args = ["--pairs", "0", "--repeat", "0", "--samples", str(args.samples)]
            run_worker(SCRIPT, "profile-stepwatch", [*diagnostic_args, "--out", str(work / "profile")])
            results["drain-configs"] = run_worker(
                SCRIPT, "drain-configs", [*diagnostic_args, "--out", str(work / "drain-configs")])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()

    def pair_row(label: str, series: dict[str, Any], reference: float | None) -> list[str]:
        ratio = f"{reference / series['median_ns']:.0f}x" if reference else ""
        return [label, _us(series["median_ns"]), _us(series["p99_ns"]), _us(series["mean_ns"]),
                _us(series["min_ns"]), f"{series['per_batch']}x{series['batches']}",
                f"{series['gc_s'] * 1000:.0f}", ratio]

    stormlog_pair = results["stormlog"]["phase_pair"]["median_ns"]
    stormlog_sink_pair = results["stormlog-sink"]["phase_pair"]["median_ns"]
    off, live, paused = results["stepwatch-off"], results["stepwatch"], results["stepwatch-paused"]
    print("Calling-thread cost per operation (us), batch means")
    print_table(
        ["operation", "median", "p99", "mean", "best", "batch x n", "gc ms", "stormlog+sink / this"],
        [
            pair_row("no-op `with` (floor)", off["noop_with"], None),
            pair_row("stepwatch off: phase pair", off["phase_pair"], stormlog_sink_pair),
            pair_row("stepwatch off: phase pair + attrs", off["phase_pair_attrs"], None),
            pair_row("stepwatch off: progress()", off["progress"], None),
            pair_row("stepwatch on+sink: phase pair", live["phase_pair"], stormlog_sink_pair),
            pair_row("stepwatch on+sink: phase pair + attrs", live["phase_pair_attrs"], None),
            pair_row("stepwatch on+sink: progress()", live["progress"], None),
            pair_row("stepwatch sampler paused: phase pair", paused["phase_pair"], stormlog_sink_pair),
            pair_row("stormlog: phase pair", results["stormlog"]["phase_pair"], stormlog_sink_pair),
            pair_row("stormlog+sink: phase pair", results["stormlog-sink"]["phase_pair"], stormlog_sink_pair),
        ],
    )
    live_pair = live["phase_pair"]["median_ns"]
    print()
    print(f"stepwatch on+sink phase pair median {_us(live_pair)} us: target <= {TARGET_PAIR_US:.0f} us "
          f"{'met' if live_pair / 1000 <= TARGET_PAIR_US else 'NOT met'}; "
          f"stormlog / stepwatch {stormlog_pair / live_pair:.0f}x, "
          f"stormlog+sink / stepwatch {stormlog_sink_pair / live_pair:.0f}x")
    drops = live["drops_at_end"]
    final = live["drops_in_stop_record"]
    queued = live["rows_queued_at_shutdown"]
    accounted = live["phase_records_on_disk"] + final["phase_rows_evicted"] + final["phase_rows_dropped_at_stop"]
    print(f"live run: {live['phase_rows_appended']:,} phase rows and {live['progress_rows_appended']:,} progress rows "
          f"appended, {live['sink_events_written_at_end']:,} records on disk when timing ended, "
          f"{drops['phase_rows_evicted']:,} phase / {drops['progress_rows_evicted']:,} progress rows evicted "
          f"(table bound {live['table_rows']:,})")
    print(f"shutdown with {queued['phases']:,} phase and {queued['progress']:,} progress rows queued took "
          f"{live['shutdown_s']:.2f} s; session {live['session_status']}; phase rows: "
          f"{live['phase_records_on_disk']:,} on disk + {final['phase_rows_evicted']:,} evicted + "
          f"{final['phase_rows_dropped_at_stop']:,} dropped at the stop deadline = {accounted:,} "
          f"of {live['phase_rows_appended_at_shutdown']:,} appended "
          f"({'all' if accounted == live['phase_rows_appended_at_shutdown'] else 'NOT all'} accounted for"
          f"{'' if not live['sink_segments_pruned'] else '; the sink pruned segments past its retention'})")
    print()

    def call_row(label: str, series: dict[str, Any], reference: float | None = None) -> list[str]:
        ratio = f"{reference / series['median_ns']:.1f}x" if reference else ""
        return [label, _us(series["median_ns"]), _us(series["p99_ns"]), _us(series["mean_ns"]),
                str(series["calls"]), ratio]

    sl, sls = results["stormlog"], results["stormlog-sink"]
    sl_sample = sls["sample"]["median_ns"]
    drain = paused["drain_per_pair"]
    print("One memory sample (us), each call timed alone; sampler threads stopped")
    print_table(
        ["operation", "median", "p99", "mean", "calls", "stormlog+sink / this"],
        [
            call_row("stepwatch runtime._sample (read+build+sink)", paused["sample"], sl_sample),
            call_row("  CpuCollector.read (memory_info+virtual_memory)", paused["sample_parts"]["collector_read"]),
            call_row("  CollectorHealth.metadata", paused["sample_parts"]["health_metadata"]),
            call_row("  EventFactory.sample", paused["sample_parts"]["event_build"]),
            call_row(f"  TelemetrySink.append (flush/{drain['sink_flush_every_events']}, fsync={drain['sink_fsync']})",
                     paused["sample_parts"]["sink_append"]),
            call_row("stepwatch tick() with forced sample", paused["tick_forced_sample"], sl_sample),
            call_row("stormlog sample tick (no sink)", sl["sample"], sl_sample),
            call_row("  _current_rss", sl["sample_parts"]["collector_read"]),
            call_row("  _add_event (no sink)", sl["sample_parts"]["event_build_and_sink_append"]),
            call_row("stormlog+sink sample tick", sls["sample"], sl_sample),
            call_row("  _add_event (+sink)", sls["sample_parts"]["event_build_and_sink_append"]),
        ],
    )
    print()
    print(f"background work per phase pair (runtime._drain(), {drain['pairs_per_drain']} pairs per drain, "
          f"sink flush every {drain['sink_flush_every_events']} events, fsync={drain['sink_fsync']!r}): "
          f"median {_us(drain['median_ns'])} us, min {_us(drain['min_ns'])}, max {_us(drain['max_ns'])} "
          f"over {drain['drains']} drains")
    print("peak RSS per worker (MiB): " + ", ".join(
        f"{name} {result['rss_peak_bytes'] / 2**20:.0f}" for name, result in results.items()
        if "rss_peak_bytes" in result))
    print("torch imported by: " + (", ".join(n for n, r in results.items() if r.get("torch_loaded")) or "none"))

    header["load_average_at_end"] = load_average()
    path = write_results("capture_overhead", {
        "header": header,
        "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
        "results": results,
        "ratios": {
            "stormlog_pair_vs_stepwatch_live_pair": stormlog_pair / live_pair,
            "stormlog_sink_pair_vs_stepwatch_live_pair": stormlog_sink_pair / live_pair,
            "stormlog_sink_sample_vs_stepwatch_sample": sl_sample / paused["sample"]["median_ns"],
            "stormlog_sample_vs_stepwatch_sample": sl["sample"]["median_ns"] / paused["sample"]["median_ns"],
        },
        "target_pair_us": TARGET_PAIR_US,
    })
    print(f"\nraw results: {path}")


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
