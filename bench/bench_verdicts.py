"""Verdict evaluation: the live 100-step window and a whole run of 64 ranks x 20,000 steps
(1.28M step rows), the live window's load from a real SQLite history of that size, and TraceML
0.5.0's own step-time diagnosis on comparable input.

Usage::

    .venv/bin/python bench/bench_verdicts.py [--ranks R] [--steps N] [--repeat K]
                                             [--traceml-steps M] [--tmp-dir DIR] [--skip-sqlite]

One fresh subprocess per contender (``_common.run_worker``); each builds its input, takes a full
collection, then times ``K`` rounds and keeps the best:

  * ``live columns``: ``diagnose`` on the last 100 steps of every rank, as ``load_verdict_inputs``
    hands them over (``StepColumns``), with the window's memory samples (target < 5 ms);
  * ``live steps-only``: the same without memory samples (the step-time verdicts alone);
  * ``live rows``: the same window as row dicts (what a caller with rows of its own pays);
  * ``full columns``: ``diagnose`` on all ``R x N`` steps (default 1.28M rows) with one memory
    sample every 10 steps per rank (target < 2 s);
  * ``full rows``: the same as row dicts (the conversion into columns included);
  * ``sqlite live``: ``load_verdict_inputs(last_steps=100)`` and then ``diagnose`` on a real
    ``history.sqlite`` holding all ``R x N`` step rows and their samples (written once, untimed),
    and the whole window's load for scale;
  * ``traceml live`` / ``traceml full``: ``StepTimeAnalyzer().analyze`` and
    ``diagnose_step_time_window`` on the same steps as TraceML's source rows (one metric map per
    step; its step-memory diagnosis has no input of this shape and is left out). The full run
    uses ``M`` steps per rank (default 2,000: TraceML takes minutes on 20,000), and the ratio is
    taken per step row.

Peak memory: ``ru_maxrss`` at the end of each worker (input included), and the evaluation's own
peak allocation from one extra, untimed round under ``tracemalloc`` (numpy's arrays included).
Every stepwatch worker checks its primary verdict names the slow rank (rank 17, forward 1 ms
slower: COMPUTE_STRAGGLER); so does TraceML's.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
from _common import SESSION_ID, T0, best_of, peak_rss_bytes, run_worker, start_report, worker_main

SCRIPT = Path(__file__).resolve()
SESSION = SESSION_ID
SLOW_RANK = 17
MS = 1_000_000
SAMPLE_EVERY = 10  # steps between two memory samples of a rank
# (window, input form): "steps-only" leaves the memory samples out
FORMS = (("live", "columns"), ("live", "steps-only"), ("live", "rows"), ("full", "columns"), ("full", "rows"))


def _stepwatch_path() -> None:
    sys.path.insert(0, str(SCRIPT.parent.parent / "src"))


def step_tuples(ranks: int, steps: int, seed: int = 0) -> list[tuple[int, ...]]:
    """(rank, step, start, end, step_ns, data_load, h2d, forward, backward, optimizer, recompute,
    wait) per step, by rank then step, as the history's steps table orders them. Under DDP the
    ranks wait in backward's all-reduce for the slow rank's extra forward millisecond."""
    rng = random.Random(seed)
    slow = slow_rank(ranks)
    out = []
    for rank in range(ranks):
        t = T0
        for step in range(steps):
            fetch = 200_000 + rng.randrange(50_000)
            forward = 3 * MS + rng.randrange(100_000) + (MS if rank == slow else 0)
            backward = 4 * MS + rng.randrange(100_000) + (0 if rank == slow else MS)
            optimizer = MS
            other = 300_000
            step_ns = fetch + forward + backward + optimizer + other
            out.append((rank, step, t, t + step_ns, step_ns, fetch, 0, forward, backward, optimizer, 0, fetch + other))
            t += step_ns + 50_000
    return out


def slow_rank(ranks: int) -> int:
    return min(SLOW_RANK, ranks - 1)


def memory_rows(steps: list[tuple[int, ...]]) -> list[dict[str, Any]]:
    rng = random.Random(1)
    return [{"rank": s[0], "timestamp_ns": s[2] + 1000, "event_type": "sample", "collector": "stepwatch.cpu_tracker",
             "device_id": -1, "allocated": (3 << 30) + rng.randrange(1 << 24), "reserved": 3 << 30,
             "free": 40 << 30, "total": 64 << 30, "host": f"node{s[0] // 8}"}
            for s in steps if s[1] % SAMPLE_EVERY == 0]


def _tail(steps: list[tuple[int, ...]], count: int, last: int) -> list[tuple[int, ...]]:
    return [s for s in steps if s[1] > last - count]


def _measure(run: Any, repeat: int) -> dict[str, Any]:
    timing = best_of(repeat, lambda _: run())
    gc.collect()
    tracemalloc.start()
    run()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {**timing, "eval_peak_alloc_bytes": peak, "peak_rss_bytes": peak_rss_bytes()}


def worker_stepwatch(args: list[str]) -> dict[str, Any]:
    """args: kind (live|full), form (columns|rows), ranks, steps, repeat."""
    kind, form, ranks, steps, repeat = args[0], args[1], int(args[2]), int(args[3]), int(args[4])
    _stepwatch_path()
    from stepwatch.analysis.verdicts import diagnose
    from stepwatch.analysis.verdicts.step_columns import COLUMNS, StepColumns

    data = step_tuples(ranks, steps)
    window = 100 if kind == "live" else None
    if window is not None:
        data = _tail(data, window, steps - 1)
    memory = memory_rows(data) if form != "steps-only" else []
    if form in ("columns", "steps-only"):
        steps_in: Any = StepColumns.from_tuples(data)
    else:
        steps_in = [dict(zip(COLUMNS, row)) for row in data]
    del data
    gc.collect()
    rss_input = peak_rss_bytes()
    result = diagnose(steps_in, memory, window=window)
    if result.primary.name != "COMPUTE_STRAGGLER" or result.primary.ranks != (slow_rank(ranks),):
        raise SystemExit(f"unexpected primary: {result.primary.to_dict()}")
    figures = _measure(lambda: diagnose(steps_in, memory, window=window), repeat)
    return {**figures, "rows": len(steps_in), "samples": len(memory), "rss_with_input_bytes": rss_input,
            "primary": result.primary.name}


def worker_sqlite(args: list[str]) -> dict[str, Any]:
    """args: path, ranks, steps, repeat: build the history once (untimed), then time the loads."""
    path, ranks, steps, repeat = Path(args[0]), int(args[1]), int(args[2]), int(args[3])
    _stepwatch_path()
    from stepwatch.analysis.verdicts import diagnose
    from stepwatch.analysis.verdicts.inputs import load_verdict_inputs
    from stepwatch.analysis.verdicts.step_columns import COLUMNS
    from stepwatch.store.sqlite import SqliteStore

    built = 0.0
    if not path.exists():
        started = time.perf_counter()
        store = SqliteStore(path)
        store.upsert_session({"session_id": SESSION, "status": "completed", "started_at_ns": T0, "ended_at_ns": None,
                              "host": "bench", "world_size": ranks, "source": "bench", "command_line": None})
        data = step_tuples(ranks, steps)
        for begin in range(0, len(data), 100_000):
            chunk = data[begin:begin + 100_000]
            store.append("steps", [{"session_id": SESSION, **dict(zip(COLUMNS, row))} for row in chunk])
        telemetry = [{"session_id": SESSION, **m, "active": None, "inactive": None, "change": 0,
                      "used": m["allocated"], "pid": 1, "context": None, "metadata": {}} for m in memory_rows(data)]
        del data
        store.append("telemetry", telemetry)
        store.close()
        built = time.perf_counter() - started
    store = SqliteStore(path, read_only=True)

    def live() -> Any:
        inputs = load_verdict_inputs(store, SESSION, last_steps=100)
        return diagnose(inputs.steps, inputs.memory, inputs.system, window=100, expected_ranks=inputs.expected_ranks)

    check = live()
    if check.primary.name != "COMPUTE_STRAGGLER":
        raise SystemExit(f"unexpected primary: {check.primary.to_dict()}")
    load_only = best_of(repeat, lambda _: load_verdict_inputs(store, SESSION, last_steps=100))
    both = best_of(repeat, lambda _: live())
    whole = best_of(1, lambda _: load_verdict_inputs(store, SESSION))
    return {"load_live_s": load_only["best_s"], "load_and_diagnose_live_s": both["best_s"],
            "load_full_s": whole["best_s"], "history_bytes": path.stat().st_size, "built_s": built,
            "peak_rss_bytes": peak_rss_bytes()}


def worker_traceml(args: list[str]) -> dict[str, Any]:
    """args: kind (live|full), ranks, steps, repeat."""
    kind, ranks, steps, repeat = args[0], int(args[1]), int(args[2]), int(args[3])
    from traceml_ai.diagnostics.step_time.api import diagnose_step_time_window
    from traceml_ai.diagnostics.step_time.policy import LIVE_STEP_TIME_POLICY, SUMMARY_STEP_TIME_POLICY
    from traceml_ai.step_time.analysis import StepTimeAnalyzer
    from traceml_ai.step_time.model import StepTimeClockValues, StepTimeRepositorySnapshot, StepTimeSourceRow

    window = 100 if kind == "live" else None
    data = step_tuples(ranks, steps)
    if window is not None:
        data = _tail(data, window, steps - 1)
    rows = []
    for source_id, (rank, step, _, _, step_ns, fetch, h2d, forward, backward, optimizer, _, _) in enumerate(data):
        def v(ns: int) -> StepTimeClockValues:
            return StepTimeClockValues(ns / 1e6, None)

        rows.append(StepTimeSourceRow(source_id, rank, step, {
            "input_wait": v(fetch), "h2d": v(h2d), "forward": v(forward), "backward": v(backward),
            "optimizer_step": v(optimizer), "traced_step_time": v(step_ns - fetch)}))
    snapshot = StepTimeRepositorySnapshot(rows=tuple(rows), global_ranks=tuple(range(ranks)))
    del data, rows
    policy = LIVE_STEP_TIME_POLICY if window else SUMMARY_STEP_TIME_POLICY

    def run() -> Any:
        return diagnose_step_time_window(StepTimeAnalyzer().analyze(snapshot, window_size=window), policy=policy)

    primary = run().primary
    timing = best_of(repeat, lambda _: run())
    return {**timing, "rows": len(snapshot.rows), "primary": primary.kind, "peak_rss_bytes": peak_rss_bytes()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def main() -> None:
    if worker_main({"stepwatch": worker_stepwatch, "sqlite": worker_sqlite, "traceml": worker_traceml}, sys.argv[1:]):
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--traceml-steps", type=int, default=2_000)
    parser.add_argument("--tmp-dir", type=Path, default=None)
    parser.add_argument("--skip-sqlite", action="store_true")
    parser.add_argument("--skip-traceml", action="store_true")
    options = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-verdicts-", dir=options.tmp_dir))
    header = start_report("verdict evaluation", tmp)
    ranks, steps, repeat_all = options.ranks, options.steps, str(options.repeat)
    results: dict[str, Any] = {}
    for kind, form in FORMS:
        repeat = repeat_all if kind == "live" else str(max(1, options.repeat // 2))
        results[f"{kind} {form}"] = run_worker(SCRIPT, "stepwatch", [kind, form, str(ranks), str(steps), repeat],
                                               timeout=1800)
    if not options.skip_sqlite:
        results["sqlite"] = run_worker(SCRIPT, "sqlite", [str(tmp / "history.sqlite"), str(ranks), str(steps),
                                                          repeat_all], timeout=3600)
    if not options.skip_traceml:
        results["traceml live"] = run_worker(SCRIPT, "traceml", ["live", str(ranks), str(steps), repeat_all],
                                             timeout=1800)
        results["traceml full"] = run_worker(SCRIPT, "traceml", ["full", str(ranks), str(options.traceml_steps), "1"],
                                             timeout=3600)
    rows = []
    for name in (f"{kind} {form}" for kind, form in FORMS):
        r = results[name]
        rows.append([f"stepwatch {name}", f"{r['rows']:,}", _ms(r["best_s"]), _ms(r["median_s"]),
                     _mib(r["eval_peak_alloc_bytes"]), _mib(r["peak_rss_bytes"])])
    for name in ("traceml live", "traceml full"):
        if name in results:
            r = results[name]
            rows.append([name, f"{r['rows']:,}", _ms(r["best_s"]), _ms(r["median_s"]), "-", _mib(r["peak_rss_bytes"])])
    _common.print_table(["contender", "step rows", "best", "median", "eval peak alloc", "peak RSS"], rows)
    if "traceml live" in results:
        live = results["traceml live"]["best_s"] / results["live columns"]["best_s"]
        per_row_tml = results["traceml full"]["best_s"] / results["traceml full"]["rows"]
        per_row_sw = results["full columns"]["best_s"] / results["full columns"]["rows"]
        print(f"\nvs TraceML 0.5.0: live window {live:.0f}x faster; whole run {per_row_tml / per_row_sw:.0f}x faster "
              f"per step row (TraceML on {results['traceml full']['rows']:,} rows: "
              f"{_ms(results['traceml full']['best_s'])})")
    if "sqlite" in results:
        s = results["sqlite"]
        print(f"\nhistory.sqlite of {ranks * steps:,} step rows ({s['history_bytes'] / 2**20:.0f} MiB): live window loaded in "
              f"{_ms(s['load_live_s'])}, loaded and judged in {_ms(s['load_and_diagnose_live_s'])}; "
              f"the whole run loaded in {_ms(s['load_full_s'])}")
    print(f"\nload average at end: {_common.load_average()}")
    path = _common.write_results("bench_verdicts", {"header": header, "results": results})
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
