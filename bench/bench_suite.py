"""Where the test suite's CPU goes: the suite run as ``make test`` runs it, every process it
starts accounted for by kind (pytest's workers, training scripts, torchrun agents, stepwatch's
launcher, aggregator and commands, browsers and servers).

Usage::

    .venv/bin/python bench/bench_suite.py [--workers N] [--top K] [-- PYTEST ARGS...]

The suite is CPU-bound on a small machine: its wall time is about its CPU time over the cores.
So this counts CPU seconds (user + system) per process, from two sources that together miss
nothing: every Python process reports its own ``getrusage`` at exit (a ``sitecustomize`` put on
``PYTHONPATH`` for the run), and a sampler reads every descendant's CPU from ``psutil`` every
0.2 s, for the processes that end by a signal (killed ranks, stopped servers) or are no Python.
A process counts once, at the larger of its two figures. Printed: the wall time, the CPU time
in all, and the CPU by kind of process, with how many there were and what each cost; the test
files and the tests whose processes cost the most (a started process inherits pytest's
PYTEST_CURRENT_TEST), and the files that cost pytest's workers the most (a plugin times each test
in its worker); each worker's last test, which shows whether the suite's end waited on one worker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
SITECUSTOMIZE = """
import atexit, json, os, resource, sys
def _report():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.environ["BENCH_SUITE_LOG"], "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cmd": " ".join(sys.orig_argv)[:400],
                              "cpu": usage.ru_utime + usage.ru_stime,
                              "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\\n")
if "BENCH_SUITE_LOG" in os.environ:
    atexit.register(_report)
"""
# in pytest's workers: the CPU each test spent in the worker itself (setup, call and teardown),
# and at the end which heavy libraries the worker had imported (each worker that imports one pays
# for it: a library the tests of one file import is best imported by one worker)
HEAVY = ("torch", "torch._dynamo", "lightning", "transformers", "accelerate", "mlflow", "tensorboard", "wandb",
         "playwright", "clickhouse_driver", "opentelemetry.sdk", "prometheus_client", "plotly", "numpy")
PLUGIN = f"""
import json, os, sys, time
import pytest

HEAVY = {HEAVY!r}

def pytest_sessionfinish(session):
    if "PYTEST_XDIST_WORKER" in os.environ:
        with open(os.environ["BENCH_SUITE_LOG"], "a") as out:
            out.write(json.dumps({{"worker_imported": [m for m in HEAVY if m in sys.modules],
                                  "worker": os.environ["PYTEST_XDIST_WORKER"]}}) + "\\n")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, began = time.process_time(), time.time()
    yield
    with open(os.environ["BENCH_SUITE_LOG"], "a") as out:
        out.write(json.dumps({{"in_worker": item.nodeid, "cpu": time.process_time() - started, "began": began,
                              "ended": time.time(), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}}) + "\\n")
"""
# (kind, pattern on the command line): the first that matches names the process
KINDS = (
    ("pytest worker", r"execnet|xdist|-c import sys;exec\(eval"),
    ("pytest", r"-m pytest"),
    ("torchrun agent", r"torch\.distributed\.run|torchrun"),
    ("stepwatch aggregator", r"-m stepwatch\.server"),
    ("stepwatch dashboard", r"stepwatch\.web\.process"),
    ("stepwatch run (launcher)", r"stepwatch(\.ui\.cli)? run "),
    ("stepwatch command", r"bin/stepwatch |stepwatch\.ui\.cli|-m stepwatch"),
    ("chromium", r"chrom"),
    ("clickhouse", r"clickhouse"),
    ("prometheus", r"prometheus"),
    ("multiprocessing child", r"multiprocessing|from multiprocessing"),
    ("python script (training)", r"\.py\b"),
    ("python -c", r"python[0-9.]* -"),
)


def kind_of(command: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, command):
            return kind
    return "other"


def _test_of(process: psutil.Process) -> str:
    """The test that started ``process`` (pytest's ``PYTEST_CURRENT_TEST``, which its children inherit)."""
    try:
        return process.environ().get("PYTEST_CURRENT_TEST", "")
    except (psutil.Error, OSError):
        return ""


def test_file(current_test: str) -> str:
    return current_test.split("::", 1)[0] if current_test else "(none: workers, shared servers)"


class Sampler(threading.Thread):
    """Every descendant of ``root``: its command line and the last CPU time seen."""

    def __init__(self, root: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.seen: dict[int, dict[str, Any]] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            parent = psutil.Process(self.root)
        except psutil.NoSuchProcess:
            return
        while not self.stopped.wait(self.interval):
            try:
                children = parent.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                try:
                    with child.oneshot():
                        times = child.cpu_times()
                        cpu = times.user + times.system
                        entry = self.seen.get(child.pid)
                        if entry is None:
                            entry = self.seen[child.pid] = {"cmd": " ".join(child.cmdline())[:400], "cpu": 0.0,
                                                           "test": _test_of(child)}
                        entry["cpu"] = max(entry["cpu"], cpu)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default=os.environ.get("TEST_WORKERS", "4"))
    parser.add_argument("--top", type=int, default=15, help="the costliest processes to list")
    parser.add_argument("--keep-log", type=Path, help="write each process (kind, CPU, test, command) to this file, a JSON line each")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stepwatch-bench-suite-") as tmp:
        log = Path(tmp) / "exits.jsonl"
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (Path(tmp) / "bench_suite_plugin.py").write_text(PLUGIN)
        env = dict(os.environ, BENCH_SUITE_LOG=str(log), PYTHONDONTWRITEBYTECODE="",  # as make test runs it
                   PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "worksteal", "-p", "no:cacheprovider",
                   "-p", "bench_suite_plugin", *args.pytest_args]
        started = time.monotonic()
        load_before = os.getloadavg()[0]
        proc = subprocess.Popen(command, cwd=REPO, env=env)
        sampler = Sampler(proc.pid)
        sampler.start()
        code = proc.wait()
        wall = time.monotonic() - started
        sampler.stopped.set()
        sampler.join()
        lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    exits = [e for e in lines if "pid" in e]
    in_workers: dict[str, float] = defaultdict(float)
    tests = [e for e in lines if "in_worker" in e]
    for e in tests:
        in_workers[test_file(e["in_worker"])] += e["cpu"]
    cpu: dict[int, tuple[str, float, str]] = {pid: (e["cmd"], e["cpu"], e["test"]) for pid, e in sampler.seen.items()}
    for e in exits:
        if e["pid"] != proc.pid:
            known = cpu.get(e["pid"])
            cpu[e["pid"]] = (e["cmd"], max(e["cpu"], known[1] if known else 0.0), e["test"] or (known[2] if known else ""))
    if args.keep_log:
        args.keep_log.write_text("".join(json.dumps({"kind": kind_of(cmd), "cpu": round(seconds, 3), "test": test,
                                                     "cmd": cmd}) + "\n" for cmd, seconds, test in cpu.values()))
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    by_test: dict[str, list[float]] = defaultdict(list)
    for command_line, seconds, current_test in cpu.values():
        kind = kind_of(command_line)
        by_kind[kind].append(seconds)
        if kind != "pytest worker":
            by_file[test_file(current_test)].append(seconds)
            by_test[current_test.rsplit(" (", 1)[0] or test_file("")].append(seconds)
    own = next((e["cpu"] for e in exits if e["pid"] == proc.pid), 0.0)
    by_kind["pytest"].append(own)
    total = sum(sum(v) for v in by_kind.values())
    cores = os.cpu_count() or 1
    print(f"\nsuite: exit {code}, wall {wall:.0f} s, CPU {total:.0f} s in {len(cpu) + 1} processes on {cores} cores "
          f"(CPU / cores = {total / cores:.0f} s), load average before {load_before:.1f}")
    print(f"{'kind':28} {'processes':>9} {'CPU s':>8} {'share':>6} {'each s':>7}")
    for kind, values in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        spent = sum(values)
        print(f"{kind:28} {len(values):9d} {spent:8.1f} {spent / total:6.1%} {spent / len(values):7.2f}")
    print(f"\nthe {args.top} test files whose processes cost the most (pytest's workers left out):")
    for name, values in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{sum(values):7.1f} s in {len(values):3d} processes  {name}")
    print(f"\nthe {args.top} tests whose processes cost the most (a module or session fixture's run counts "
          "for the test that asked first):")
    for name, values in sorted(by_test.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{sum(values):7.1f} s in {len(values):3d} processes  {name}")
    print(f"\nthe {args.top} test files that cost pytest's workers the most ({sum(in_workers.values()):.0f} s in all):")
    for name, seconds in sorted(in_workers.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:7.1f} s  {name}")
    if tests:
        # the tail: each worker's last test, the suite waiting on the slowest of them
        last = {}
        for e in tests:
            if e["ended"] > last.get(e["worker"], {"ended": 0})["ended"]:
                last[e["worker"]] = e
        end = max(e["ended"] for e in tests)
        print("\neach worker's last test (the suite's end waits on them):")
        for e in sorted(last.values(), key=lambda e: e["ended"]):
            print(f"  {e['worker'] or 'main':5} done {end - e['ended']:5.1f} s before the end, "
                  f"{e['ended'] - e['began']:5.1f} s long: {e['in_worker'][:110]}")
    imported = [e for e in lines if "worker_imported" in e]
    if imported:
        print(f"\nheavy libraries, by how many of the {len(imported)} workers imported them:")
        for library in HEAVY:
            workers = sorted(e["worker"] for e in imported if library in e["worker_imported"])
            print(f"  {library:20} {len(workers)}  {' '.join(workers)}")
    print(f"\nthe {args.top} costliest processes:")
    for command_line, seconds, _ in sorted(cpu.values(), key=lambda c: -c[1])[:args.top]:
        print(f"{seconds:7.1f} s  {command_line[:150]}")
    sys.exit(code)


if __name__ == "__main__":
    main()
