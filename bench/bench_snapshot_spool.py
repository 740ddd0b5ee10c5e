"""Snapshot statistics per million parameters, and spool write throughput in spans/s:
stepwatch vs cirron-sdk 0.3.0 (the SDK whose spool format stepwatch writes), each in its own
subprocess.

Usage::

    .venv/bin/python bench/bench_snapshot_spool.py [--repeat 5] [--spans 50000] [--batch 10000]
        [--only NAME ...] [--tmp-dir DIR] [--torch-threads 1]

Two measurements, one worker subprocess per contender and measurement (``--worker NAME``,
through ``_common.run_worker``):

**Snapshot statistics** (``snapshot-stepwatch``, ``snapshot-cirron``): the per-tensor statistics
(mean, std, min, max, L2 norm, 16-bin histogram) of every parameter and its gradient, after one
backward pass, on three models:

  * ``mlp-1M``: a ReLU MLP 512 -> 1024 -> 512 -> 10 (6 parameter tensors, ~1.06M parameters);
  * ``mlp-16M``: 2048 -> 4096 -> 2048 -> 10 (6 tensors, ~16.8M parameters): per-element cost;
  * ``many-small``: 64 ``Linear(32, 32)`` layers (128 tensors, ~68k parameters): per-tensor cost.

Every parameter has a gradient, so a model gives twice its parameter tensors as records.

stepwatch: ``stepwatch.capture.snapshots.snapshot_model(model, mode="stats", ...)`` (what
``stepwatch.snapshot(model)`` runs on the calling thread); cirron:
``capture_weight_stats(model, span_id) + capture_gradient_stats(model, span_id)`` and
``snapshot_to_dict`` of each record (what its epoch hook runs; it computes on a pool of up to 4
threads once a model has 32 tensors or more). Best of ``--repeat`` after a warm-up call, in
milliseconds per million parameters (weights and gradients both summarised: 2 x the parameter
count of tensor elements) and per tensor.

**Spool writing** (``spool-stepwatch``, ``spool-cirron``): ``--spans`` closed spans shaped like a
training loop's (a ``step`` with attrs and four phase children under an epoch, a ``loss`` mark
on every step) turned into spool batches of ``--batch`` spans on a background thread's path:

  * stepwatch: ``SpanRecorder.span_records()`` + ``mark_records()`` (ids formatted, step
    breakdown built, attrs cleaned) and ``SpoolWriter.write()`` (one msgspec encode, temp file
    and ``os.replace``), as ``Runtime._seal_spool`` does; the spans are closed through the
    ``TrainingState`` hot path beforehand (untimed);
  * cirron: ``_scope_to_dict`` / ``_mark_to_dict`` of closed ``Scope`` / ``Mark`` objects, a
    ``Batch`` and ``SpoolWriter.write()`` (its JSON encoder, temp file, ``os.replace``), as its
    flush thread's ``drain_once`` does.

Both write ``fsync``-free into ``--tmp-dir``; spans/s = spans / (records + encode + write time),
best of ``--repeat``; the split between building the records and writing them is shown, and
the bytes per span on disk.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    best_of,
    format_rate,
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
CONTENDERS = ("stepwatch", "cirron")
MODELS = ("mlp-1M", "mlp-16M", "many-small")
PHASE_NAMES = ("data_load", "forward", "backward", "optimizer_step")


# -- snapshot statistics ---------------------------------------------------------------------------


def _model(name: str) -> Any:
    """A seeded model with gradients from one backward pass (so gradients are summarised too)."""
    import torch

    torch.manual_seed(0)
    if name == "many-small":
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(64)])
        x = torch.randn(8, 32)
    else:
        width = {"mlp-1M": 512, "mlp-16M": 2048}[name]
        model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                    torch.nn.Linear(2 * width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        x = torch.randn(8, width)
    model(x).square().mean().backward()
    return model


def _snapshot_worker(argv: list[str], contender: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, required=True)
    parser.add_argument("--torch-threads", type=int, required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    if contender == "stepwatch":
        from stepwatch.capture.snapshots import snapshot_model

        counter = iter(range(1, 1 << 62))

        def run(model: Any) -> int:
            records, _ = snapshot_model(model, span_id="0" * 32, mode="stats", sample_rate=0.0,
                                        blob_uri=lambda span_id, kind: "", ts_ns=time.time_ns(), attrs=None,
                                        new_id=lambda: f"{next(counter):032x}")
            return len(records)
    else:
        from cirron.snapshots.stats import capture_gradient_stats, capture_weight_stats
        from cirron.snapshots.types import snapshot_to_dict

        def run(model: Any) -> int:
            records = capture_weight_stats(model, "0" * 32) + capture_gradient_stats(model, "0" * 32)
            return len([snapshot_to_dict(r) for r in records])

    out: dict[str, Any] = {}
    for name in MODELS:
        model = _model(name)
        params = sum(p.numel() for p in model.parameters())
        tensors = sum(1 + (p.grad is not None) for p in model.parameters())
        made = run(model)  # warm-up (and, for cirron, its thread pool)
        if made != tensors:
            raise SystemExit(f"{contender} made {made} records for {name}, expected {tensors}")
        timing = best_of(args.repeat, lambda _state, model=model: run(model))
        out[name] = {"params": params, "tensors": tensors, **timing,
                     "ms_per_million_params": timing["best_s"] * 1e3 / (params / 1e6),
                     "us_per_tensor": timing["best_s"] * 1e6 / tensors}
    return {"models": out, "rss_peak_bytes": peak_rss_bytes()}


# -- spool writing -------------------------------------------------------------------------------


def _spool_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--spans", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--repeat", type=int, required=True)
    return parser.parse_args(argv)


def _spool_stepwatch(argv: list[str]) -> dict[str, Any]:
    args = _spool_args(argv)
    from stepwatch.artifacts.spool import SpoolWriter
    from stepwatch.capture.spans import SpanRecorder
    from stepwatch.capture.training import TrainingState

    recorder = SpanRecorder(rank=0, rows=args.batch * 2)
    state = TrainingState(recorder, snapshot_sink=lambda records, job: None, blob_uri=lambda s, k: "")
    steps_per_batch = args.batch // 5  # a step and its four phases

    def fill(_state: Any = None) -> None:
        """One batch of closed spans and marks, as a traced loop leaves them (untimed)."""
        epoch = state.open_epoch(0)
        for _ in range(steps_per_batch):
            now = time.time_ns()
            state.record_fetch(now - 1000, now)
            step = state.open_step(None, {"framework": "torch"})
            for name in PHASE_NAMES[1:]:
                state.end_phase(state.begin_phase(name))
            recorder.mark_on(step, "loss", 0.25, "point", None)  # type: ignore[arg-type]
            state.close_step(step, None)
        state.close_epoch(epoch)  # type: ignore[arg-type]

    return _spool_rounds(args, "stepwatch", fill,
                         build=lambda: (recorder.span_records(), recorder.mark_records()),
                         write=lambda writer, built: writer.write(built[0], built[1], []),
                         writer=lambda root: SpoolWriter(root, sdk_version="bench", max_bytes=1 << 40))


def _spool_cirron(argv: list[str]) -> dict[str, Any]:
    args = _spool_args(argv)
    import os
    import threading
    import uuid

    from cirron.core.flush import Batch, SpoolWriter, _mark_to_dict, _scope_to_dict
    from cirron.core.mark import Mark
    from cirron.core.scope import Scope

    pid, thread = os.getpid(), threading.get_ident()
    steps_per_batch = args.batch // 5
    pending: dict[str, list[Any]] = {"scopes": [], "marks": []}

    def close(scope: Scope) -> Scope:
        scope.end_ns = time.time_ns()
        pending["scopes"].append(scope)
        return scope

    def fill(_state: Any = None) -> None:
        """The same tree as cirron's scope stack closes it (ids are os.urandom(16).hex() there too)."""
        epoch = Scope(os.urandom(16).hex(), "epoch", 0, {}, None, time.time_ns(), None, thread, pid, 0)
        for index in range(steps_per_batch):
            step = Scope(os.urandom(16).hex(), "step", index, {"framework": "torch"}, epoch.id, time.time_ns(), None,
                         thread, pid, 0)
            for name in PHASE_NAMES:
                close(Scope(os.urandom(16).hex(), name, None, {}, step.id, time.time_ns(), None, thread, pid, 0))
            mark = Mark(id=os.urandom(16).hex(), span_id=step.id, name="loss", value_type="float", value=0.25,
                        attrs={}, ts_ns=time.time_ns(), kind="point")
            step.marks.append(mark.id)
            pending["marks"].append(mark)
            step.attrs.update({"step_ns": 1, "data_load_ns": 1, "forward_ns": 1, "backward_ns": 1,
                               "optimizer_step_ns": 1, "wait_ns": 0})
            close(step)
        close(epoch)

    def build() -> Any:
        scopes, marks = pending["scopes"], pending["marks"]
        pending["scopes"], pending["marks"] = [], []
        return Batch(batch_id=uuid.uuid4().hex, created_ns=time.time_ns(), spans=[_scope_to_dict(s) for s in scopes],
                     marks=[_mark_to_dict(m) for m in marks], snapshots=[])

    return _spool_rounds(args, "cirron", fill, build=build, write=lambda writer, batch: [writer.write(batch)],
                         writer=lambda root: SpoolWriter(root, max_bytes=1 << 40))


def _spool_rounds(args: argparse.Namespace, contender: str, fill: Callable[..., None], *, build: Callable[[], Any],
                  write: Callable[[Any, Any], list[Path]], writer: Callable[[Path], Any]) -> dict[str, Any]:
    """Rounds of: fill ``--spans`` spans in batches (untimed), then per batch time building the
    records and writing the batch; keeps the best round."""
    import gc

    batches = max(1, args.spans // args.batch)
    rounds: list[dict[str, float]] = []
    for round_index in range(args.repeat + 1):  # the first round warms up
        root = args.dir / f"{contender}-{round_index}"
        spool = writer(root)
        built_s = write_s = 0.0
        spans = 0
        for _ in range(batches):
            fill()
            gc.collect()
            started = time.perf_counter()
            built = build()
            middle = time.perf_counter()
            paths = write(spool, built)
            ended = time.perf_counter()
            built_s += middle - started
            write_s += ended - middle
            spans += len(built[0] if isinstance(built, tuple) else built.spans)
        size = sum(p.stat().st_size for p in root.glob("*.json"))
        if round_index:
            rounds.append({"build_s": built_s, "write_s": write_s, "total_s": built_s + write_s, "spans": spans,
                           "bytes": size, "files_last_batch": len(paths)})
        shutil.rmtree(root, ignore_errors=True)
    best = min(rounds, key=lambda r: r["total_s"])
    return {"best": best, "rounds": rounds, "spans_per_s": best["spans"] / best["total_s"],
            "build_us_per_span": best["build_s"] / best["spans"] * 1e6,
            "write_us_per_span": best["write_s"] / best["spans"] * 1e6,
            "bytes_per_span": best["bytes"] / best["spans"], "rss_peak_bytes": peak_rss_bytes()}


WORKERS: dict[str, Callable[[list[str]], dict[str, Any]]] = {
    "snapshot-stepwatch": lambda argv: _snapshot_worker(argv, "stepwatch"),
    "snapshot-cirron": lambda argv: _snapshot_worker(argv, "cirron"),
    "spool-stepwatch": _spool_stepwatch,
    "spool-cirron": _spool_cirron,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds, best kept (default 5)")
    parser.add_argument("--spans", type=int, default=50_000, help="spans written per spool round (default 50000)")
    parser.add_argument("--batch", type=int, default=10_000,
                        help="spans per spool batch (default 10000: ~2 s of a 1.5 ms/step loop)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads in the workers (default 1)")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    header = machine_header(args.tmp_dir)
    header["versions"] = versions("stepwatch", "cirron-sdk", "torch", "msgspec")
    print_header("snapshot statistics and spool writing: stepwatch vs cirron-sdk", header)
    work = Path(tempfile.mkdtemp(prefix="bench-snapshot-spool-", dir=args.tmp_dir))
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in args.only:
            print(f"running snapshot-{name} ... (load average {load_average()})", flush=True)
            results[f"snapshot-{name}"] = run_worker(
                SCRIPT, f"snapshot-{name}", ["--repeat", str(args.repeat), "--torch-threads", str(args.torch_threads)])
            print(f"running spool-{name} ... (load average {load_average()})", flush=True)
            results[f"spool-{name}"] = run_worker(
                SCRIPT, f"spool-{name}", ["--dir", str(work), "--spans", str(args.spans), "--batch", str(args.batch),
                                          "--repeat", str(args.repeat)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()

    rows = []
    for model in MODELS:
        base = results.get("snapshot-cirron", {}).get("models", {}).get(model)
        for name in args.only:
            m = results[f"snapshot-{name}"]["models"][model]
            ratio = f"{base['best_s'] / m['best_s']:.2f}x" if base else ""
            rows.append([f"{name} / {model}", f"{m['params'] / 1e6:.3f}", m["tensors"], f"{m['best_s'] * 1e3:.2f}",
                         f"{m['median_s'] * 1e3:.2f}", f"{m['ms_per_million_params']:.2f}", f"{m['us_per_tensor']:.1f}",
                         ratio])
    print_table(["snapshot stats: contender / model", "M params", "tensors", "best ms", "median ms",
                 "ms per M params", "µs per tensor", "cirron / this"], rows)
    print(f"\n(weights and gradients; torch threads {args.torch_threads}; cirron computes on up to 4 pool threads "
          "from 32 tensors up)\n")

    rows = []
    base_rate = results.get("spool-cirron", {}).get("spans_per_s")
    for name in args.only:
        r = results[f"spool-{name}"]
        rows.append([name, format_rate(r["spans_per_s"]), f"{r['build_us_per_span']:.2f}",
                     f"{r['write_us_per_span']:.2f}", f"{r['bytes_per_span']:.0f}",
                     f"{r['spans_per_s'] / base_rate:.2f}x" if base_rate else ""])
    print_table(["spool writing", "spans/s", "records µs/span", "encode+write µs/span", "B/span on disk",
                 "vs cirron"], rows)
    print(f"\n({args.spans} spans per round in batches of {args.batch}, a step and 4 phases per 5 spans and one mark "
          f"per step; best of {args.repeat})")
    header["load_average_at_end"] = load_average()
    print(f"\nload average at end: {header['load_average_at_end']}")
    path = write_results("snapshot_spool", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                            "results": results})
    print(f"raw results: {path}")


if __name__ == "__main__":
    if not worker_main(WORKERS, sys.argv[1:]):
        main()
