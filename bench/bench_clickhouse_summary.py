"""The final summary and the live verdict window of a many-rank run, on ClickHouse and on SQLite:
the same step rows in both (``--ranks`` x ``--steps``, default 1,024 x 2,000 = 2.05M rows, one
memory sample per rank every 10 steps, stored a tick of 20 steps of every rank at a time, as the
aggregator stores them), plus a session a quarter that size to see how the times grow.

Usage::

    .venv/bin/python bench/bench_clickhouse_summary.py [--ranks 1024] [--steps 2000] [--repeat 2]
        [--url clickhouse://default@127.0.0.1:PORT/db --server-pid PID] [--tmp-dir DIR] [--keep]

Without ``--url`` a private Debian ``clickhouse-server`` is started from ``--tmp-dir`` (as the
tests' fixture starts it, ``tests/support/clickhouse.py``) and stopped at the end. Each round
is a fresh interpreter per store (``_common.run_worker``) that times:

* ``build_summary(store, session)`` whole (stepwatch.analysis.summary);
* its one step read alone (``session_steps``: every step row of the session moved to the
  client as columns), so what is left is the client's own work on them;
* ``load_verdict_inputs(store, session, last_steps=100)`` then ``diagnose`` on it (the live
  window: 100 steps x every rank), and each of the window's queries apart;
* on ClickHouse, ``store.step_aggregates`` (the summary's statistics reduced on the server) and
  one ``GROUP BY rank`` with quantiles through the view and on the table.

Each figure carries the worker's CPU time and, on ClickHouse, the server's CPU time over the
same call (``/proc/<pid>/stat``): which side the time is spent on. Issue 23 §5 asks for 20M
rows (1,024 x ~20k) in < 1 s; the times at two sizes give the slope to extrapolate to it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO_ROOT,
    SLOW_RANK,
    T0,
    TICK_STEPS,
    aggregator_ticks,
    load_average,
    machine_header,
    peak_rss_bytes,
    process_cpu_seconds,
    run_worker,
    worker_main,
)

SCRIPT = Path(__file__).resolve()
TARGET_ROWS = 1024 * 20_000
TARGET_S = 1.0


def _session(size: str) -> str:
    return {"small": "0000000a-0000-4000-8000-000000000000", "big": "0000000b-0000-4000-8000-000000000000"}[size]


def _write(stores: dict[str, Any], ranks: int, sizes: dict[str, int], server_pid: int | None) -> dict[str, Any]:
    """The same ticks into every store; each store's write wall and CPU time (ClickHouse: + the server's)."""
    spent = {name: [0.0, 0.0, 0.0] for name in stores}
    for number, (size, steps) in enumerate(sizes.items()):
        session = _session(size)
        for store in stores.values():
            store.upsert_session({"session_id": session, "status": "completed", "started_at_ns": T0 + number,
                                  "ended_at_ns": None, "host": "bench", "world_size": ranks, "source": "bench",
                                  "command_line": None})
        for rows, samples in aggregator_ticks(session, ranks, steps, number):
            for name, store in stores.items():
                wall, cpu, server = time.perf_counter(), time.process_time(), process_cpu_seconds(server_pid)
                store.append_many({"steps": rows, "telemetry": samples})
                spent[name][0] += time.perf_counter() - wall
                spent[name][1] += time.process_time() - cpu
                spent[name][2] += process_cpu_seconds(server_pid) - server if name == "clickhouse" else 0.0
    return {name: {"wall_s": w, "cpu_s": c, "server_cpu_s": s} for name, (w, c, s) in spent.items()}


def _timed(server_pid: int | None, fn: Any) -> tuple[Any, dict[str, float]]:
    wall, cpu, server = time.perf_counter(), time.process_time(), process_cpu_seconds(server_pid)
    out = fn()
    return out, {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                 "server_cpu_s": process_cpu_seconds(server_pid) - server, "load_1m": os.getloadavg()[0]}


def worker_read(argv: list[str]) -> dict[str, Any]:
    """argv: store (path or URL), session, server pid or '-': the three timed reads."""
    target, session, pid_text = argv
    pid = None if pid_text == "-" else int(pid_text)
    from stepwatch.analysis.summary import build_summary
    from stepwatch.analysis.verdicts.engine import diagnose
    from stepwatch.analysis.verdicts.inputs import load_verdict_inputs, session_steps
    from stepwatch.store import open_store

    store = open_store(target if "://" in target else Path(target), read_only=True)
    summary, whole = _timed(pid, lambda: build_summary(store, session))
    primary = summary["diagnosis"]["primary"]
    if primary is None or primary["name"] != "COMPUTE_STRAGGLER" or primary["ranks"] != [SLOW_RANK]:
        raise SystemExit(f"unexpected primary verdict: {primary}")
    steps, read = _timed(pid, lambda: session_steps(store, session))
    rows = len(steps.arrays["rank"])
    del steps
    inputs, window_read = _timed(pid, lambda: load_verdict_inputs(store, session, last_steps=100))
    found, window_diagnose = _timed(pid, lambda: diagnose(inputs.steps, inputs.memory, inputs.system, window=100,
                                                          expected_ranks=inputs.expected_ranks))
    if found.primary is None or found.primary.name != "COMPUTE_STRAGGLER":
        raise SystemExit(f"unexpected window verdict: {found.primary}")
    aggregates = None
    if hasattr(store, "step_aggregates"):  # the statistics reduced on the server (ClickHouse store)
        _, aggregates = _timed(pid, lambda: store.step_aggregates(session))
    parts = _window_parts(store, session, pid)
    floor = _server_reduction(store, session, pid) if pid is not None else None
    store.close()
    return {"rows": rows, "summary": whole, "step_read": read, "window_read": window_read,
            "window_rows": len(inputs.steps), "window_diagnose": window_diagnose, "window_parts": parts,
            "server_reduction": floor, "step_aggregates": aggregates, "peak_rss_bytes": peak_rss_bytes()}


def _window_parts(store: Any, session: str, pid: int | None) -> dict[str, dict[str, float]]:
    """``load_verdict_inputs(last_steps=100)``'s queries one by one (as it issues them), to see
    which one the time is in."""
    from stepwatch.analysis.verdicts import inputs as vi

    parts: dict[str, dict[str, float]] = {}
    _, parts["world size (sessions)"] = _timed(pid, lambda: vi._expected_ranks(store, session))
    own = getattr(store, "rank_last_steps", None)
    found, parts["each rank's last step"] = _timed(
        pid, lambda: own(session) if own is not None else store.query(vi._LAST_STEPS, (session,)))
    lasts = {int(r["rank"]): int(r["last"]) for r in found if r["last"] is not None}
    ranks, high = sorted(lasts), min(lasts.values())
    marks = ", ".join("?" * len(ranks))
    sql = (f"SELECT {vi._STEP_SELECT} FROM steps WHERE session_id = ? AND rank IN ({marks}) AND step BETWEEN ? AND ? "
           "ORDER BY rank, step")
    steps, parts["the window's step rows"] = _timed(
        pid, lambda: vi._step_columns(store, sql, (session, *ranks, high - 99, high)))
    span = steps.span()
    _, parts["its memory samples"] = _timed(pid, lambda: store.query(
        f"SELECT {vi._MEMORY_SELECT} FROM telemetry WHERE session_id = ? AND rank IN ({marks}) AND timestamp_ns "
        "BETWEEN ? AND ? AND event_type = 'sample' ORDER BY rank, timestamp_ns", (session, *ranks, *span)))
    _, parts["NVML utilisation samples"] = _timed(pid, lambda: vi._gpu_utilisation(store, session, ranks, span))
    return parts


def _server_reduction(store: Any, session: str, pid: int | None) -> dict[str, dict[str, float]]:
    """What the summary's per-rank statistics cost when the server computes them (one GROUP BY
    rank: count, quantiles of the step time, each phase's mean; 1,024 rows come back): through
    the view (FINAL, as stepwatch reads today) and on the table itself."""
    from stepwatch.analysis.verdicts.step_columns import COLUMNS

    phases = ", ".join(f"avg({c})" for c in COLUMNS[5:])
    out = {}
    for label, source in (("view (FINAL)", "steps"), ("table (no FINAL)", "steps_rows")):
        sql = (f"SELECT rank, count(), quantiles(0.5, 0.9, 0.99)(step_ns), {phases} FROM {source} "
               "WHERE session_id = ? GROUP BY rank ORDER BY rank")
        _, out[label] = _timed(pid, lambda sql=sql: store.query_tuples(sql, (session,)))
    return out


def _start_server(home: Path) -> Any:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.clickhouse import PrivateClickHouse

    return PrivateClickHouse(home)


def _line(label: str, t: dict[str, float], extra: str = "") -> str:
    server = f", server CPU {t['server_cpu_s']:.2f} s" if t["server_cpu_s"] else ""
    return (f"    {label:<34} {t['wall_s']:7.2f} s wall, client CPU {t['cpu_s']:.2f} s{server}"
            f" (load {t['load_1m']:.1f}){extra}")


def main() -> None:
    if worker_main({"read": worker_read}, sys.argv[1:]):
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--url", default=None, help="a ClickHouse database URL (default: a private server's)")
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--tmp-dir", type=Path, default=Path("/tmp/stepwatch-bench-chsummary"))
    parser.add_argument("--keep", action="store_true", help="keep the server's data and the history.sqlite")
    args = parser.parse_args()
    args.tmp_dir.mkdir(parents=True, exist_ok=True)
    header = machine_header(args.tmp_dir)
    print(f"{header['cpu']} x{header['cpu_count']}, stepwatch {header['stepwatch_commit']}, "
          f"load at start {header['load_average_at_start']}")
    from stepwatch.store.clickhouse import ClickHouseStore
    from stepwatch.store.sqlite import SqliteStore

    server = None
    if args.url is None:
        server = _start_server(args.tmp_dir)
        args.url, args.server_pid = server.url("bench_summary"), server.pid
    sqlite_path = args.tmp_dir / f"history-{args.ranks}x{args.steps}.sqlite"
    sqlite_path.unlink(missing_ok=True)
    sizes = {"small": max(TICK_STEPS, args.steps // 4), "big": args.steps}
    try:
        stores = {"clickhouse": ClickHouseStore(args.url), "sqlite": SqliteStore(sqlite_path)}
        load = load_average()
        written = _write(stores, args.ranks, sizes, args.server_pid)
        for store in stores.values():
            store.close()
        rows = args.ranks * sum(sizes.values())
        print(f"wrote {rows:,} step rows (+{rows // 10:,} samples) into each store (load {load} -> {load_average()}):")
        for name, w in written.items():
            server_cpu = f", server CPU {w['server_cpu_s']:.1f} s" if w["server_cpu_s"] else ""
            print(f"  {name}: {w['wall_s']:.1f} s wall, client CPU {w['cpu_s']:.1f} s{server_cpu} "
                  f"= {rows / w['wall_s']:,.0f} rows/s")
        results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for size in sizes:
            for name, target, pid in (("clickhouse", args.url, args.server_pid), ("sqlite", str(sqlite_path), None)):
                rounds = [run_worker(SCRIPT, "read", [target, _session(size), str(pid) if pid else "-"])
                          for _ in range(args.repeat)]
                results.setdefault(size, {})[name] = rounds
        for size, steps in sizes.items():
            n = args.ranks * steps
            print(f"\n{args.ranks} ranks x {steps:,} steps = {n:,} step rows (best of {args.repeat} by wall):")
            for name, rounds in results[size].items():
                best = {key: min((r[key] for r in rounds), key=lambda t: t["wall_s"])
                        for key in ("summary", "step_read", "window_read", "window_diagnose")}
                rss = max(r["peak_rss_bytes"] for r in rounds) / 2**20
                print(f"  {name} (worker peak RSS {rss:.0f} MiB):")
                print(_line("build_summary", best["summary"]))
                print(_line("  its step read (session_steps)", best["step_read"],
                            f", {best['step_read']['wall_s'] * 1e9 / n:.0f} ns/row"))
                print(_line("load_verdict_inputs(last_steps=100)", best["window_read"],
                            f", {rounds[0]['window_rows']:,} rows"))
                print(_line("diagnose (that window)", best["window_diagnose"]))
                for part, t in rounds[-1]["window_parts"].items():
                    print(_line(f"  window: {part}", t))
                if rounds[-1].get("step_aggregates"):
                    best_agg = min((r["step_aggregates"] for r in rounds), key=lambda t: t["wall_s"])
                    print(_line("store.step_aggregates (on the server)", best_agg))
                for part, t in (rounds[-1]["server_reduction"] or {}).items():
                    print(_line(f"server GROUP BY rank, {part}", t))
        print(f"\nextrapolated to {TARGET_ROWS:,} rows, linear in rows through the two sizes, on CPU seconds "
              f"(client + server: the load moves wall times by 2x here; target < {TARGET_S} s wall):")
        small_n, big_n = args.ranks * sizes["small"], args.ranks * sizes["big"]

        def cpu(t: dict[str, float]) -> float:
            return t["cpu_s"] + t["server_cpu_s"]

        for name in ("clickhouse", "sqlite"):
            for key in ("summary", "step_read", "window_read"):
                a = min(cpu(r[key]) for r in results["small"][name])
                b = min(cpu(r[key]) for r in results["big"][name])
                slope = max(0.0, (b - a) / (big_n - small_n))
                print(f"  {name:<10} {key:<12} {b:6.2f} CPU s at {big_n:,} -> ~{b + slope * (TARGET_ROWS - big_n):.1f} "
                      f"CPU s ({slope * 1e9:.0f} ns per added row)")
        if args.server_pid:
            for part in ("view (FINAL)", "table (no FINAL)"):
                a = min(r["server_reduction"][part]["server_cpu_s"] for r in results["small"]["clickhouse"])
                b = min(r["server_reduction"][part]["server_cpu_s"] for r in results["big"]["clickhouse"])
                slope = max(0.0, (b - a) / (big_n - small_n))
                print(f"  clickhouse server GROUP BY rank, {part}: {b:.2f} server CPU s at {big_n:,} -> "
                      f"~{b + slope * (TARGET_ROWS - big_n):.1f} s ({slope * 1e9:.0f} ns per added row)")
        print(f"load average at end: {load_average()}")
    finally:
        if not args.keep:
            sqlite_path.unlink(missing_ok=True)
            for suffix in ("-wal", "-shm"):
                Path(f"{sqlite_path}{suffix}").unlink(missing_ok=True)
        if server is not None:
            server.stop()
            if not args.keep:
                shutil.rmtree(server.home, ignore_errors=True)


if __name__ == "__main__":
    main()
