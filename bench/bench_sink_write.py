"""Write throughput of the append-only telemetry sink: stepwatch against Stormlog 0.4.3.

Usage::

    .venv/bin/python bench/bench_sink_write.py [--events N] [--repeat K] [--tmp-dir DIR] [--profile]

Each contender runs in its own subprocess: it builds ``N`` identical records up front (structs
for stepwatch, the same records as dicts for Stormlog, which only takes mappings), then, best of
``K``, opens a fresh sink in a new directory and times ``append()`` of every record plus
``close()``; the directory is checked (line count) and removed outside the timed region.

Contenders:
  * ``stepwatch buffered``: ``SinkConfig(flush_every_events=10000, fsync="close")``;
  * ``stepwatch buffered, dicts``: the same, fed dicts (each one validated as v3 by append);
  * ``stepwatch default``: ``SinkConfig()``: flush every 50 events, fsync data and manifest;
  * ``stormlog buffered``: ``TelemetrySinkConfig(flush_every_events=10000)``;
  * ``stormlog default``: ``TelemetrySinkConfig()``: flush every 50 events.
Every config raises retention (files and bytes) so nothing is pruned, and Stormlog runs with
``write_rollups=False``: its rollups re-read the whole sink at close with its own loader.
Stormlog fsyncs at every flush (it has no knob), so both buffered rows fsync once per 10,000
events (stepwatch at each segment rollover), and both default rows once per 50.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    SESSION_ID,
    best_of,
    current_rss_bytes,
    format_rate,
    load_average,
    machine_header,
    make_records,
    peak_rss_bytes,
    print_header,
    print_table,
    run_worker,
    worker_main,
    write_results,
)

SCRIPT = Path(__file__).resolve()
KEEP_ALL = {"retention_max_files": 1_000_000, "retention_max_total_bytes": 1 << 50}
TARGET_EVENTS_PER_S = 300_000

# name -> (label, library, input kind, config overrides, the Stormlog row it is compared with)
CONTENDERS: dict[str, tuple[str, str, str, dict[str, Any], str | None]] = {
    "stepwatch-buffered": (
        "stepwatch buffered (10k, fsync=close)", "stepwatch", "struct",
        {"flush_every_events": 10_000, "fsync": "close"}, "stormlog-buffered",
    ),
    "stepwatch-buffered-dicts": (
        "stepwatch buffered, dict input", "stepwatch", "dict",
        {"flush_every_events": 10_000, "fsync": "close"}, "stormlog-buffered",
    ),
    "stepwatch-default": (
        "stepwatch default (50, fsync=flush)", "stepwatch", "struct", {}, "stormlog-default",
    ),
    "stormlog-buffered": (
        "stormlog buffered (10k, fsync/flush)", "stormlog", "dict",
        {"flush_every_events": 10_000}, None,
    ),
    "stormlog-default": ("stormlog default (50, fsync/flush)", "stormlog", "dict", {}, None),
}


# -- workers (one contender per process) -------------------------------------------------------


def _segment_lines(root: Path) -> tuple[int, int]:
    lines = size = 0
    for path in root.glob("segment-*.jsonl"):
        data = path.read_bytes()
        lines += data.count(b"\n")
        size += len(data)
    return lines, size


def _stepwatch_sink(config: dict[str, Any]) -> tuple[Any, Any]:
    from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
    from stepwatch.schema import SessionSummary

    sink_config = SinkConfig(**KEEP_ALL, **config)

    def open_sink(root: Path) -> Any:
        sink = TelemetrySink(root, sink_config)
        sink.start_session(
            SessionSummary(
                session_id=SESSION_ID, status="running", started_at_ns=time.time_ns(),
                host="bench-node-01", pid=os.getpid(), source="bench",
            )
        )
        return sink

    return open_sink, sink_config


def _stormlog_sink(config: dict[str, Any]) -> tuple[Any, Any]:
    from stormlog.session import create_session_summary
    from stormlog.telemetry_sink import AppendOnlyTelemetrySink, TelemetrySinkConfig

    def open_sink(root: Path) -> Any:
        sink = AppendOnlyTelemetrySink(
            TelemetrySinkConfig(root_dir=root, write_rollups=False, **KEEP_ALL, **config)
        )
        sink.start_session(create_session_summary(source="bench", session_id=SESSION_ID))
        return sink

    return open_sink, config


def _prepare(name: str, argv: list[str]) -> tuple[argparse.Namespace, Any, list[Any], dict[str, Any]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True)
    parser.add_argument("--tmp-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    _, library, kind, config, _ = CONTENDERS[name]
    open_sink, resolved = (_stepwatch_sink if library == "stepwatch" else _stormlog_sink)(config)
    if kind == "struct":
        from stepwatch.schema import TelemetryEventV3

        records: list[Any] = [TelemetryEventV3(**r) for r in make_records(args.events)]
    else:
        records = list(make_records(args.events))
    info = {"config": repr(resolved), "input": kind}
    return args, open_sink, records, info


def _write_worker(name: str, argv: list[str]) -> dict[str, Any]:
    args, open_sink, records, info = _prepare(name, argv)
    baseline = peak_rss_bytes()
    baseline_now = current_rss_bytes()
    checked: list[tuple[int, int]] = []

    def setup() -> tuple[Path, Any]:
        root = Path(tempfile.mkdtemp(prefix=f"bench-write-{name}-", dir=args.tmp_dir))
        return root, open_sink(root)

    def run(state: tuple[Path, Any]) -> None:
        sink = state[1]
        append = sink.append
        for record in records:
            append(record)
        sink.close()

    def teardown(state: tuple[Path, Any], _result: None) -> None:
        checked.append(_segment_lines(state[0]))
        shutil.rmtree(state[0])

    timing = best_of(args.repeat, run, setup, teardown)
    lines, size = checked[0]
    if any(c[0] != args.events for c in checked):
        raise SystemExit(f"{name}: segments hold {[c[0] for c in checked]} lines, expected {args.events}")
    peak = peak_rss_bytes()
    return {
        **info,
        **timing,
        "events": args.events,
        "events_per_s": args.events / timing["best_s"],
        "bytes_on_disk": size,
        "bytes_per_event_on_disk": size / lines,
        "rss_baseline_bytes": baseline,
        "rss_baseline_now_bytes": baseline_now,
        "rss_peak_bytes": peak,
        "rss_delta_bytes": peak - baseline,
    }


def _profile_worker(name: str, argv: list[str]) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    args, open_sink, records, _ = _prepare(name, argv)
    root = Path(tempfile.mkdtemp(prefix=f"bench-profile-{name}-", dir=args.tmp_dir))
    sink = open_sink(root)
    profiler = cProfile.Profile()
    profiler.enable()
    for record in records:
        sink.append(record)
    sink.close()
    profiler.disable()
    shutil.rmtree(root)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"cProfile of {name}, {args.events} events, sorted by own time:")
    print(out.getvalue().strip())
    return {}


WORKERS = {name: (lambda argv, name=name: _write_worker(name, argv)) for name in CONTENDERS}
WORKERS.update(
    {f"profile-{name}": (lambda argv, name=name: _profile_worker(name, argv)) for name in CONTENDERS}
)


# -- the parent --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="records per round (default 200000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per contender; best is kept (default 5)")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the sink directories are written (default: the temp dir)")
    parser.add_argument("--only", nargs="*", choices=list(CONTENDERS), help="run only these contenders")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one round of stepwatch buffered and print the top functions")
    args = parser.parse_args()

    header = machine_header(args.tmp_dir)
    print_header(f"sink write: {args.events:,} events, best of {args.repeat}", header)
    common = ["--events", str(args.events), "--repeat", str(args.repeat), "--tmp-dir", str(args.tmp_dir)]
    results: dict[str, dict[str, Any]] = {}
    for name in args.only or CONTENDERS:
        print(f"running {name} ...", flush=True)
        results[name] = run_worker(SCRIPT, name, common)
    print()

    rows = []
    for name, result in results.items():
        label, _, _, _, against = CONTENDERS[name]
        ratio = ""
        if against in results:
            ratio = f"{result['events_per_s'] / results[against]['events_per_s']:.2f}x"
        rows.append([
            label,
            format_rate(result["events_per_s"]),
            f"{result['best_s']:.3f}",
            f"{result['median_s']:.3f}",
            f"{result['gc_s_in_best']:.3f}",
            f"{result['bytes_per_event_on_disk']:.0f}",
            f"{result['rss_delta_bytes'] / 2**20:.1f}",
            ratio,
        ])
    print_table(
        ["contender", "events/s", "best s", "median s", "gc s", "B/event disk", "peak RSS +MiB", "vs stormlog"],
        rows,
    )
    if "stepwatch-buffered" in results:
        rate = results["stepwatch-buffered"]["events_per_s"]
        verdict = "met" if rate >= TARGET_EVENTS_PER_S else "NOT met"
        print(f"\ntarget >= {TARGET_EVENTS_PER_S // 1000}k events/s for stepwatch buffered: {verdict} ({format_rate(rate)})")
    print("(vs stormlog: events/s ratio to the Stormlog row with the same flush cadence, same run)")

    if args.profile:
        print()
        run_worker(SCRIPT, "profile-stepwatch-buffered", common)

    header["load_average_at_end"] = load_average()
    path = write_results("sink_write", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                        "results": results})
    print(f"\nraw results: {path}")


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
