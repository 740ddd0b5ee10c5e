"""Load throughput and memory of sink directories: stepwatch's loader against Stormlog 0.4.3's.

Usage::

    .venv/bin/python bench/bench_load.py [--events N] [--subset M] [--repeat K] [--tmp-dir DIR]
                                         [--keep-data] [--profile]

A first subprocess writes the data once with stepwatch's sink (``flush_every_events=10000``,
``fsync="close"``, default rollover of 10,000 events per segment, retention raised so nothing
is pruned): ``N`` records (default 1,000,000) into one sink directory, and the first ``M`` of
the same records (default 100,000) into a second. Then one fresh subprocess per contender
takes its peak-RSS baseline after its imports and times ``load_telemetry_sessions(dir)``, best
of ``K``, after a full collection each round, dropping each result before the next:

  * ``stepwatch N``: stepwatch loads the big directory;
  * ``stepwatch M``: stepwatch loads the subset (the apples-to-apples row);
  * ``stormlog M``: ``stormlog.telemetry.load_telemetry_sessions`` loads the subset (Stormlog
    reads v3 records and stepwatch's manifest; it returns v4 objects).

The ``stepwatch M`` worker also times, after its loads, ``msgspec`` alone on the same records:
every segment's bytes already read into memory, decoded by one ``decode_lines`` call each into
``TelemetryEventV3`` with the cyclic GC off, nothing else (no file access, identity check,
grouping or summary). No loader that returns one ``TelemetryEventV3`` per record can pass this
figure by much: it is the cost of building the objects.

Every worker checks it got one session of the expected number of events and returns a checksum
of a counter over all of them; the parent checks the subset checksums agree.
Peak RSS per event is ``(ru_maxrss at the end - ru_maxrss after imports) / events``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    RECORD_SHAPES,
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
TARGET_RATIO = 30.0

# worker -> (library, which directory)
CONTENDERS = {
    "stepwatch-full": ("stepwatch", "full"),
    "stepwatch-subset": ("stepwatch", "subset"),
    "stormlog-subset": ("stormlog", "subset"),
}


# -- workers -----------------------------------------------------------------------------------


def _prepare_worker(argv: list[str]) -> dict[str, Any]:
    """Writes the two sink directories with stepwatch's sink."""
    import os

    from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
    from stepwatch.schema import SessionSummary, TelemetryEventV3

    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--subset", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--records", choices=RECORD_SHAPES, required=True)
    args = parser.parse_args(argv)
    config = SinkConfig(
        flush_every_events=10_000, fsync="close",
        retention_max_files=1_000_000, retention_max_total_bytes=1 << 50,
    )
    out: dict[str, Any] = {}
    for name, count in (("full", args.events), ("subset", args.subset)):
        root = args.out / name
        started = time.perf_counter()
        sink = TelemetrySink(root, config)
        sink.start_session(
            SessionSummary(
                session_id=SESSION_ID, status="running", started_at_ns=time.time_ns(),
                host="bench-node-01", pid=os.getpid(), source="bench",
            )
        )
        checksum = 0
        for record in make_records(count, shape=args.records):
            checksum += record["allocator_allocated_bytes"]
            sink.append(TelemetryEventV3(**record))
        sink.close()
        segments = sorted(root.glob("segment-*.jsonl"))
        out[name] = {
            "dir": str(root),
            "events": count,
            "checksum": checksum,
            "segments": len(segments),
            "bytes": sum(p.stat().st_size for p in segments),
            "write_s_incl_record_generation": time.perf_counter() - started,
        }
    return out


def _loader(library: str) -> Any:
    if library == "stepwatch":
        from stepwatch.telemetry import load_telemetry_sessions
    else:
        from stormlog.telemetry import load_telemetry_sessions
    return load_telemetry_sessions


def _check(sessions: list[Any], expected: int) -> int:
    if len(sessions) != 1 or len(sessions[0].events) != expected:
        found = [len(s.events) for s in sessions]
        raise SystemExit(f"expected one session of {expected} events, found sessions of {found}")
    return sum(e.allocator_allocated_bytes for e in sessions[0].events)


def _load_worker(name: str, argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True)
    args = parser.parse_args(argv)
    load = _loader(CONTENDERS[name][0])
    import gc

    gc.collect()
    baseline = peak_rss_bytes()
    baseline_now = current_rss_bytes()
    checksums: list[int] = []

    def teardown(_state: None, sessions: list[Any]) -> None:
        checksums.append(_check(sessions, args.events))

    timing = best_of(args.repeat, lambda _state: load(args.dir), teardown=teardown)
    peak = peak_rss_bytes()
    decode = _decode_alone(args.dir, args.repeat) if name == "stepwatch-subset" else None
    if len(set(checksums)) != 1:
        raise SystemExit(f"{name}: checksums differ between rounds: {checksums}")
    return {
        **timing,
        "dir": str(args.dir),
        "events": args.events,
        "events_per_s": args.events / timing["best_s"],
        "checksum": checksums[0],
        "rss_baseline_bytes": baseline,
        "rss_baseline_now_bytes": baseline_now,
        "rss_peak_bytes": peak,
        "rss_delta_bytes": peak - baseline,
        "rss_bytes_per_event": (peak - baseline) / args.events,
        "decode_alone_events_per_s": decode,
    }


def _decode_alone(path: Path, repeat: int) -> float:
    """Events/s of msgspec decoding the segments' bytes (in memory) into TelemetryEventV3."""
    import gc

    import msgspec

    from stepwatch.schema import TelemetryEventV3

    decode = msgspec.json.Decoder(TelemetryEventV3).decode_lines
    data = [segment.read_bytes() for segment in sorted(path.glob("segment-*.jsonl"))]

    def run(_state: None) -> list[Any]:
        gc.disable()  # as the loader does while it builds its objects
        try:
            return [decode(chunk) for chunk in data]
        finally:
            gc.enable()

    return sum(chunk.count(b"\n") for chunk in data) / best_of(repeat, run)["best_s"]


def _profile_worker(name: str, argv: list[str]) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True)
    args = parser.parse_args(argv)
    load = _loader(CONTENDERS[name][0])
    load(args.dir)  # warm the page cache and lazy imports, as the timed rounds see them
    profiler = cProfile.Profile()
    profiler.enable()
    sessions = load(args.dir)
    profiler.disable()
    _check(sessions, args.events)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"cProfile of {name}, {args.events} events, sorted by own time:")
    print(out.getvalue().strip())
    return {}


WORKERS: dict[str, Any] = {"prepare": _prepare_worker}
WORKERS.update({name: (lambda argv, name=name: _load_worker(name, argv)) for name in CONTENDERS})
WORKERS.update(
    {f"profile-{name}": (lambda argv, name=name: _profile_worker(name, argv)) for name in CONTENDERS}
)


# -- the parent --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="records in the big sink (default 1000000)")
    parser.add_argument("--subset", type=int, default=100_000,
                        help="records in the subset sink, loaded by both (default 100000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds per contender; best is kept (default 5)")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the sink directories are written (default: the temp dir)")
    parser.add_argument("--records", choices=RECORD_SHAPES, default="collector",
                        help="record shape: what the CPU collector writes (default) or the lean 4-key metadata")
    parser.add_argument("--keep-data", action="store_true", help="leave the sink directories behind")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one stepwatch load of each directory and print the top functions")
    args = parser.parse_args()
    if args.subset > args.events:
        parser.error("--subset must not exceed --events")

    header = machine_header(args.tmp_dir)
    print_header(
        f"sink load: stepwatch {args.events:,} events; stepwatch and stormlog {args.subset:,}; "
        f"best of {args.repeat}; {args.records} records",
        header,
    )
    data_dir = Path(tempfile.mkdtemp(prefix="bench-load-", dir=args.tmp_dir))
    try:
        print("writing the sink directories with stepwatch ...", flush=True)
        prepared = run_worker(
            SCRIPT, "prepare",
            ["--events", str(args.events), "--subset", str(args.subset), "--out", str(data_dir),
             "--records", args.records],
        )
        for name in ("full", "subset"):
            info = prepared[name]
            print(f"  {name}: {info['events']:,} events, {info['segments']} segments, "
                  f"{info['bytes'] / 2**20:.1f} MiB ({info['bytes'] / info['events']:.0f} B/event)")
        results: dict[str, dict[str, Any]] = {}
        for name, (_, which) in CONTENDERS.items():
            print(f"running {name} ...", flush=True)
            info = prepared[which]
            results[name] = run_worker(
                SCRIPT, name,
                ["--dir", info["dir"], "--events", str(info["events"]), "--repeat", str(args.repeat)],
            )
            if results[name]["checksum"] != info["checksum"]:
                raise SystemExit(f"{name} loaded other data than was written (checksum mismatch)")
        if args.profile:
            for name in ("stepwatch-full", "stepwatch-subset"):
                info = prepared[CONTENDERS[name][1]]
                run_worker(SCRIPT, f"profile-{name}",
                           ["--dir", info["dir"], "--events", str(info["events"]), "--repeat", "1"])
    finally:
        if args.keep_data:
            print(f"sink directories kept in {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
    print()

    stormlog_rate = results["stormlog-subset"]["events_per_s"]
    rows = []
    for name, result in results.items():
        library, _ = CONTENDERS[name]
        rows.append([
            f"{library} {result['events']:,} events",
            format_rate(result["events_per_s"]),
            f"{result['best_s']:.3f}",
            f"{result['median_s']:.3f}",
            f"{result['gc_s_in_best']:.3f}",
            f"{result['rss_delta_bytes'] / 2**20:.0f}",
            f"{result['rss_bytes_per_event']:.0f}",
            f"{result['events_per_s'] / stormlog_rate:.1f}x",
        ])
    print_table(
        ["contender", "events/s", "best s", "median s", "gc s", "peak RSS +MiB", "RSS B/event", "vs stormlog"],
        rows,
    )
    issue_ratio = results["stepwatch-full"]["events_per_s"] / stormlog_rate
    same_ratio = results["stepwatch-subset"]["events_per_s"] / stormlog_rate
    print()
    print(f"ratio stepwatch {args.events:,} / stormlog {args.subset:,} (events/s): {issue_ratio:.1f}x "
          f"(target >= {TARGET_RATIO:.0f}x: {'met' if issue_ratio >= TARGET_RATIO else 'NOT met'})")
    print(f"ratio stepwatch {args.subset:,} / stormlog {args.subset:,} (same files):  {same_ratio:.1f}x "
          f"(target >= {TARGET_RATIO:.0f}x: {'met' if same_ratio >= TARGET_RATIO else 'NOT met'})")
    decode_rate = results["stepwatch-subset"]["decode_alone_events_per_s"]
    print(f"msgspec alone, the subset's bytes in memory -> TelemetryEventV3: {format_rate(decode_rate)} = "
          f"{decode_rate / stormlog_rate:.1f}x stormlog (the loader on the same files: "
          f"{results['stepwatch-subset']['events_per_s'] / decode_rate:.0%} of it)")
    memory_ratio = results["stormlog-subset"]["rss_bytes_per_event"] / results["stepwatch-subset"]["rss_bytes_per_event"]
    print(f"peak RSS per event, stormlog / stepwatch on the same files: {memory_ratio:.1f}x")

    header["load_average_at_end"] = load_average()
    path = write_results("load", {
        "header": header,
        "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
        "data": prepared,
        "results": results,
        "ratios": {"stepwatch_full_vs_stormlog_subset": issue_ratio,
                   "stepwatch_subset_vs_stormlog_subset": same_ratio,
                   "decode_alone_vs_stormlog_subset": decode_rate / stormlog_rate,
                   "rss_per_event_stormlog_vs_stepwatch_subset": memory_ratio},
    })
    print(f"\nraw results: {path}")


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
