"""Shared helpers of the benchmark programs: machine header, worker subprocesses, best of N.

A benchmark program runs as a parent that measures nothing itself: it starts one fresh
subprocess per contender (``python bench/<program>.py --worker NAME ...``), reads the one JSON
object the worker prints on its last stdout line, and prints the table. A worker imports only
what its contender needs, so peak RSS and import side effects never leak between contenders.

Nothing here imports stepwatch or stormlog at module level: the record generator yields plain
dicts, and each worker builds its own record type from them.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent

# The metadata every record carries: what the CPU collector of a run without a GPU writes.
RECORD_METADATA = {
    "backend": "cpu",
    "supports_device_total": False,
    "supports_device_free": False,
    "sampling_source": "psutil",
}
# What stepwatch's CPU collector really writes in every sample (collector health, spec
# telemetry-event-v3.md "Collector health metadata", plus the process's virtual size).
COLLECTOR_METADATA = {
    "backend": "cpu",
    "supports_device_total": True,
    "supports_device_free": True,
    "sampling_source": "psutil",
    "collector_health_status": "healthy",
    "telemetry_partial": False,
    "collector_partial_fields": [],
    "collector_last_error": None,
    "collector_consecutive_failures": 0,
    "collector_next_retry_epoch_s": None,
}
RECORD_SHAPES = ("lean", "collector")
SESSION_ID = "5b0c8f4e-3a1d-4c2b-9e7f-0123456789ab"
T0 = 1_790_000_000_000_000_000  # the synthetic histories' first instant (ns, 2026)
_MS = 1_000_000
SLOW_RANK = 17  # the compute straggler of aggregator_ticks' runs
TICK_STEPS = 20  # steps of every rank in one aggregator tick (one transaction)

__all__ = [
    "aggregator_ticks",
    "BENCH_DIR",
    "COLLECTOR_METADATA",
    "RECORD_SHAPES",
    "RECORD_METADATA",
    "RESULTS_DIR",
    "SESSION_ID",
    "SLOW_RANK",
    "T0",
    "TICK_STEPS",
    "GcTimer",
    "Measured",
    "best_of",
    "cpu_seconds",
    "process_cpu_seconds",
    "current_rss_bytes",
    "finish_report",
    "format_rate",
    "load_average",
    "machine_header",
    "make_records",
    "peak_rss_bytes",
    "print_header",
    "print_table",
    "run_worker",
    "start_report",
    "worker_main",
    "write_results",
]


# -- records -----------------------------------------------------------------------------------


def make_records(
    n: int,
    session_id: str = SESSION_ID,
    *,
    seed: int = 0,
    start_ns: int = 1_790_000_000_000_000_000,
    host: str = "bench-node-01",
    pid: int = 4242,
    shape: str = "lean",
) -> Iterator[dict[str, Any]]:
    """``n`` valid TelemetryEvent v3 records as plain dicts, deterministic for a given seed.

    Shaped like the CPU collector's samples at 100 ms: time-ordered timestamps with jitter,
    allocator counters on a random walk, one marker record in a hundred with a context
    string, and a fresh small metadata dict per record (as a collector builds it).
    ``shape="lean"``: the four capability keys of ``RECORD_METADATA``, device free/total null
    (678 B/record). ``shape="collector"``: every key stepwatch's CPU collector writes
    (``COLLECTOR_METADATA`` plus a changing ``vms_bytes``), device free/total filled (~950 B).
    """
    if shape not in RECORD_SHAPES:
        raise ValueError(f"shape must be one of {RECORD_SHAPES}, got {shape!r}")
    collector = shape == "collector"
    rng = random.Random(seed)
    allocated = 512 * 1024 * 1024
    reserved = allocated + 64 * 1024 * 1024
    timestamp = start_ns
    for i in range(n):
        timestamp += 100_000_000 + rng.randrange(-2_000_000, 2_000_000)
        change = rng.randrange(-8 * 1024 * 1024, 8 * 1024 * 1024 + 1)
        allocated = max(0, allocated + change)
        reserved = max(reserved, allocated + rng.randrange(0, 32 * 1024 * 1024))
        marker = i % 100 == 99
        yield {
            "schema_version": 3,
            "session_id": session_id,
            "timestamp_ns": timestamp,
            "event_type": "marker" if marker else "sample",
            "collector": "stepwatch.cpu_tracker",
            "sampling_interval_ms": 100,
            "pid": pid,
            "host": host,
            "device_id": -1,
            "allocator_allocated_bytes": allocated,
            "allocator_reserved_bytes": reserved,
            "allocator_active_bytes": None,
            "allocator_inactive_bytes": None,
            "allocator_change_bytes": change,
            "device_used_bytes": reserved + 12_345_678,
            "device_free_bytes": 24 * 2**30 - reserved if collector else None,
            "device_total_bytes": 25_276_502_016 if collector else None,
            "context": f"step {i // 100}" if marker else None,
            "metadata": (
                COLLECTOR_METADATA | {"collector_partial_fields": [], "vms_bytes": reserved + 2**30}
                if collector
                else dict(RECORD_METADATA)
            ),
            "job_id": None,
            "rank": 0,
            "local_rank": 0,
            "world_size": 1,
        }


# -- measuring ---------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss`` is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int | None:
    """This process's resident set size now, where ``/proc`` says (Linux); else None."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system): the figure to trust on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of another process so far (a server's, from /proc), 0 without one."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Measured:
    """``with Measured() as m: ...`` then ``m.result(**more)``: the block's wall and CPU seconds and
    the worker's peak RSS (interpreter and imports included), the row every export worker returns."""

    def __enter__(self) -> Measured:
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, cpu_seconds() - self.cpu

    def result(self, **more: Any) -> dict[str, Any]:
        return {"wall_s": round(self.wall, 2), "cpu_s": round(self.cpu, 2), "peak_rss_bytes": peak_rss_bytes(), **more}


class GcTimer:
    """Sums the wall time the cyclic garbage collector runs, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def best_of(
    repeat: int,
    run: Callable[[Any], Any],
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[Any, Any], None] | None = None,
) -> dict[str, Any]:
    """Times ``run(state)`` ``repeat`` times, each after a full collection; keeps the best.

    ``state = setup()`` (None without one) and ``teardown(state, result)`` run outside the
    timed region; the result is dropped before the next round, so two results never live at
    once and the process's peak RSS stays one round's peak.
    """
    times: list[float] = []
    gc_seconds: list[float] = []
    gc_counts: list[list[int]] = []
    for _ in range(repeat):
        state = setup() if setup is not None else None
        gc.collect()
        with GcTimer() as gc_timer:
            started = time.perf_counter()
            result = run(state)
            elapsed = time.perf_counter() - started
        times.append(elapsed)
        gc_seconds.append(gc_timer.seconds)
        gc_counts.append(gc_timer.collections)
        if teardown is not None:
            teardown(state, result)
        state = result = None
    best = min(range(repeat), key=times.__getitem__)
    return {
        "best_s": times[best],
        "times_s": times,
        "median_s": sorted(times)[len(times) // 2],
        "gc_s_in_best": gc_seconds[best],
        "gc_collections_in_best": gc_counts[best],
    }


# -- subprocesses ------------------------------------------------------------------------------


def run_worker(script: Path, name: str, args: Sequence[str], timeout: float = 600) -> dict[str, Any]:
    """Runs ``script --worker name args...`` in a fresh interpreter; returns its JSON result."""
    command = [sys.executable, str(script), "--worker", name, *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"worker {name} failed with exit status {proc.returncode}: {' '.join(command)}")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"worker {name} printed no result")
    for line in lines[:-1]:
        print(f"  [{name}] {line}")
    return json.loads(lines[-1])


def worker_main(workers: dict[str, Callable[[list[str]], dict[str, Any]]], argv: list[str]) -> bool:
    """Runs the worker named after ``--worker`` when present; returns False when this is the parent."""
    if len(argv) < 2 or argv[0] != "--worker":
        return False
    name, rest = argv[1], argv[2:]
    result = workers[name](rest)
    result.setdefault("worker", name)
    print(json.dumps(result))
    return True


# -- the machine -------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(*dists: str) -> dict[str, str]:
    """Installed versions of ``dists`` ("not installed" for a missing one), for a bench header."""
    return {dist: _version(dist) for dist in dists}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _filesystem_of(path: Path) -> str:
    """``device type`` of the mount holding ``path`` (Linux ``/proc/mounts``), else ``unknown``."""
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split() for line in handle]
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    best = ("", "unknown")
    for fields in mounts:
        device, mount_point, fs_type = fields[0], fields[1], fields[2]
        if (resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")) and len(
            mount_point
        ) > len(best[0]):
            best = (mount_point, f"{device} {fs_type} at {mount_point}")
    return best[1]


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "--no-optional-locks", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_digest() -> str:
    """Short sha256 over ``src/stepwatch/**/*.py``: ties figures to the exact code, committed or not."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "src" / "stepwatch").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_header(tmp_dir: Path) -> dict[str, Any]:
    """Versions, hardware and the file system the benchmark writes to."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": _memory_total_bytes(),
        "tmp_dir": str(tmp_dir),
        "tmp_filesystem": _filesystem_of(tmp_dir),
        "versions": {name: _version(name) for name in ("stepwatch", "stormlog", "msgspec")},
        "stepwatch_commit": (commit + ("-dirty" if dirty else "")) if commit else None,
        "stepwatch_source_sha256": source_digest(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": load_average(),
        "argv": sys.argv,
    }


def print_header(title: str, header: dict[str, Any]) -> None:
    memory = header["memory_total_bytes"]
    versions = ", ".join(f"{k} {v}" for k, v in header["versions"].items())
    print(f"== {title} ==")
    print(f"{header['python']} on {header['platform']}")
    print(
        f"{header['cpu']}, {header['cpu_count']} CPUs, "
        f"{memory / 2**30:.1f} GiB RAM" if memory else f"{header['cpu']}, {header['cpu_count']} CPUs"
    )
    print(f"{versions}; stepwatch commit {header['stepwatch_commit']}, "
          f"src sha256 {header['stepwatch_source_sha256']}")
    print(f"temp files: {header['tmp_dir']} ({header['tmp_filesystem']})")
    load = header["load_average_at_start"]
    if load is not None:
        busy = load[0] > 0.5 * (header["cpu_count"] or 1)
        note = "  <- the machine is busy: figures will be low and noisy" if busy else ""
        print(f"load average at start (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}{note}")
    print()


# -- output ------------------------------------------------------------------------------------


def format_rate(events_per_s: float) -> str:
    if events_per_s >= 1e6:
        return f"{events_per_s / 1e6:.2f}M/s"
    if events_per_s >= 1e3:
        return f"{events_per_s / 1e3:.1f}k/s"
    return f"{events_per_s:.0f}/s"


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row: list[str]) -> str:
        return "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def start_report(title: str, tmp_dir: Path) -> dict[str, Any]:
    """The machine's header (``machine_header``), printed under ``title``; returned for the results."""
    header = machine_header(tmp_dir)
    print_header(title, header)
    return header


def finish_report(name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], payload: dict[str, Any]) -> Path:
    """The table, the load average now, and ``payload`` (with that load average) in results/."""
    print_table(columns, rows)
    print(f"load average {load_average()}, pid {os.getpid()}")
    return write_results(name, {**payload, "load_average": load_average()})


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Writes the raw results to ``bench/results/<name>.json`` (git-ignored); returns the path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# -- a synthetic run, as the aggregator stores it ------------------------------------------------


def aggregator_ticks(session: str, ranks: int, steps: int, seed: int) -> Iterator[tuple[list[Any], list[Any]]]:
    """(step rows, memory samples) of a synthetic run, one aggregator tick at a time: every
    rank's next ``TICK_STEPS`` steps, sorted by time as the ranks' frames arrive, a memory sample
    every 10 steps. Rank ``SLOW_RANK`` is a compute straggler. Needs stepwatch on ``sys.path``."""
    from stepwatch.analysis.verdicts.step_columns import COLUMNS

    rng = random.Random(seed)
    clock = [T0] * ranks
    for first in range(0, steps, TICK_STEPS):
        rows, samples = [], []
        for rank in range(ranks):
            for step in range(first, min(first + TICK_STEPS, steps)):
                fetch = 200_000 + rng.randrange(50_000)
                forward = 3 * _MS + rng.randrange(100_000) + (_MS if rank == SLOW_RANK else 0)
                backward = 4 * _MS + rng.randrange(100_000) + (0 if rank == SLOW_RANK else _MS)
                step_ns = fetch + forward + backward + _MS + 300_000
                t = clock[rank]
                values = (rank, step, t, t + step_ns, step_ns, fetch, 0, forward, backward, _MS, 0, fetch + 300_000)
                rows.append({"session_id": session, **dict(zip(COLUMNS, values))})
                if step % 10 == 0:
                    samples.append({"session_id": session, "rank": rank, "timestamp_ns": t + 1000,
                                    "event_type": "sample", "collector": "stepwatch.cpu_tracker", "device_id": -1,
                                    "allocated": (3 << 30) + rng.randrange(1 << 24), "reserved": 3 << 30,
                                    "free": 40 << 30, "total": 64 << 30, "host": f"node{rank // 8}",
                                    "active": None, "inactive": None, "change": 0, "used": 3 << 30, "pid": 1,
                                    "context": None, "metadata": {}})
                clock[rank] = t + step_ns + 50_000
        rows.sort(key=lambda r: r["start_ns"])
        yield rows, samples
