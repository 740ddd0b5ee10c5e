"""The experiment-tracker exports of a synthetic 20,000-step run: reading the per-step points
from the history, then MLflow (``log_batch`` into a fresh SQLite tracking store) and
TensorBoard (event files), each in a fresh subprocess: wall time, CPU time (user + system, the
figure to trust on a shared machine), peak RSS of the whole worker, points written.

Usage::

    .venv/bin/python bench/bench_tracker_export.py [--steps 20000] [--ranks 2] [--tmp-dir DIR]

The history is bench_export.py's (each step a ``step`` span and four phases, a memory sample
and a loss mark per step), built once into ``DIR``, untimed; its ``steps`` rows come from the
step spans' attrs as the aggregator would write them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Measured, finish_report, run_worker, start_report, worker_main
from bench_export import SESSION, SPANS_PER_STEP, T0
from bench_export import build as build_spans


def build(args: list[str]) -> dict[str, Any]:
    """bench_export's history plus the ``steps`` rows the aggregator derives from the step spans."""
    from stepwatch.phases import STEP_COLUMNS
    from stepwatch.store.sqlite import SqliteStore

    path, steps, ranks = Path(args[0]), int(args[1]), int(args[2])
    out = build_spans([str(path), str(steps * ranks * SPANS_PER_STEP), str(ranks)])
    with SqliteStore(path) as store:
        for rank in range(ranks):
            rows = []
            for step in range(steps):
                t = T0 + step * 10_000_000
                rows.append({"session_id": SESSION, "rank": rank, "step": step, "start_ns": t, "end_ns": t + 9_000_000,
                             "step_ns": 9_000_000, **dict.fromkeys(STEP_COLUMNS, 0),
                             "forward_ns": 3_000_000, "backward_ns": 4_000_000, "wait_ns": 2_000_000})
            store.append("steps", rows)
    return out


def _points(path: Path) -> tuple[list[Any], dict[str, str]]:
    from stepwatch.exports.tracker_data import tracker_params, tracker_points
    from stepwatch.store.sqlite import SqliteStore

    with SqliteStore(path, read_only=True) as store:
        return tracker_points(store, SESSION), tracker_params(store, SESSION, {})


def points(args: list[str]) -> dict[str, Any]:
    with Measured() as took:
        found, _params = _points(Path(args[0]))
    return took.result(points=sum(len(p.values) for p in found))


def mlflow(args: list[str]) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from stepwatch.exports.mlflow_export import export_mlflow

    path, db = Path(args[0]), Path(args[1])
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # the store's tables made before the clock
    with Measured() as took:
        found, params = _points(path)
        done = export_mlflow(found, params, {}, {"stepwatch.session_id": SESSION}, [], tracking_uri=f"sqlite:///{db}",
                             experiment="bench", per_rank=False, run_name="bench", start_ms=None, end_ms=None)
    return took.result(points=done.metric_points)


def tensorboard(args: list[str]) -> dict[str, Any]:
    from stepwatch.exports.tensorboard import write_tensorboard

    path, out = Path(args[0]), Path(args[1])
    with Measured() as took:
        found, params = _points(path)
        stats = write_tensorboard(found, out, text=params, session_id=SESSION)
    return took.result(points=stats.scalars)


WORKERS = {"build": build, "points": points, "mlflow": mlflow, "tensorboard": tensorboard}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tmp-dir", type=Path, default=None)
    options = parser.parse_args()
    tmp = options.tmp_dir or Path(tempfile.mkdtemp(prefix="stepwatch-bench-trackers-"))
    tmp.mkdir(parents=True, exist_ok=True)
    header = start_report("Tracker exports", tmp)
    store = tmp / f"history-steps-{options.steps}-{options.ranks}.sqlite"
    if not store.exists():
        print(f"  built {store.name}: {run_worker(Path(__file__), 'build', [str(store), str(options.steps), str(options.ranks)], timeout=3600)}")
    results = {"points": run_worker(Path(__file__), "points", [str(store)], timeout=3600)}
    db = tmp / "mlflow.db"
    db.unlink(missing_ok=True)
    results["mlflow"] = run_worker(Path(__file__), "mlflow", [str(store), str(db)], timeout=3600)
    results["tensorboard"] = run_worker(Path(__file__), "tensorboard", [str(store), str(tmp / f"tb-{os.getpid()}")],
                                        timeout=3600)
    rows = [(name, f"{r['points']:,}", r["wall_s"], r["cpu_s"], f"{r['points'] / max(r['cpu_s'], 1e-9) / 1e3:.0f}k",
             f"{r['peak_rss_bytes'] / 2**20:.0f}") for name, r in results.items()]
    finish_report("bench_tracker_export", ("export", "points", "wall s", "cpu s", "points/cpu s", "peak RSS MiB"), rows,
                  {"header": header, "options": {**vars(options), "tmp_dir": str(tmp)}, "results": results})


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
