"""The background work of capture counted in instructions: what stepwatch's own threads (the
sampler, and any other it starts) execute per second of training, for an out-of-the-box
``stepwatch.init()`` on a small MLP fed by a DataLoader, on CPU; with no aggregator, and with
one connected as under ``stepwatch run``.

Usage::

    .venv/bin/python bench/bench_sampler_instructions.py [--modes init run] [--ticks 5 15] [--rate R]
        [--per-step N] [--annotate] [--profile] [--tmp-dir DIR] [--keep]

Why instructions: the sampler is time-driven (a tick a second) and competes with the training
thread for the GIL, which on a 2-core machine is a core's share that training does not get.
Its CPU time on a shared machine swings with the load; callgrind's instruction count of one
thread does not.

How. One process per mode runs under ``valgrind --tool=callgrind --separate-threads=yes
--instr-atstart=no`` (``--worker MODE``): it imports torch and stepwatch uninstrumented, then
forks one child per run (callgrind follows a fork into a file of the child's own). Each child
starts capture the way the mode says, runs one uninstrumented warm-up pass, turns
instrumentation on (callgrind's client requests, ``bench_step_instructions._ClientRequests``),
trains for ``T`` seconds of wall time, sleeps ``I`` seconds with capture still on (the program
doing something else: the time-driven work alone), and stops capture. Its exit dump has one
file per thread. Three runs, ``(T1, 0)``, ``(T2, 0)`` and ``(T1, T2 - T1)``, give per thread

    I = a * seconds + b * steps + c

solved exactly: ``a`` the instructions per second that time alone costs (ticks, samples,
polls, heartbeats, flushes), ``b`` those each training step adds (its spans and marks built,
encoded, written and shipped), ``c`` start and stop, which cancel. Under valgrind training is
~50x slower than native while ticks keep wall time, so the figure that counts is per second of
*native* training: ``a + b * R``, with ``R`` the steps per second the same loop makes outside
valgrind with capture on (measured first, in a native child: ``--worker native``). The table
also prints the plain two-length difference ``(I(T2) - I(T1)) / (T2 - T1)`` at valgrind's pace.

Threads are told apart by their dumps: the training thread is callgrind's thread 1; a thread
whose dump runs ``thread_run`` (CPython's thread bootstrap) is a Python thread, named by the
order the child started its Python threads (``threading.Thread.start`` is wrapped to note the
names). Modes:

  * ``init``: ``stepwatch.init(out=DIR)``, defaults (interval 1 s, heartbeat 5 s, spool 2 s);
  * ``run``: as a rank of ``stepwatch run`` sees it: an aggregator (``python -m stepwatch.server
    --launched``, native, one per child) and the launcher's variables (``STEPWATCH_AGGREGATOR``,
    ``STEPWATCH_LAUNCHER=run``, rank 0 of 1), then the same ``stepwatch.init()``.

The loop: ``bench_training_overhead.Workload`` (a ReLU MLP 16 -> 64 x 2 -> 10, batch 16,
``DataLoader`` over an in-memory ``TensorDataset``, SGD momentum, cross-entropy, one torch
thread), steps inferred by the patches (no ``trace_step``: a program with no stepwatch code).

``--per-step N``: the per-step part alone, with no timing in it (``_ticks_by_hand``): one process
a mode under callgrind stops the sampler thread and runs its tick itself, on the training thread,
after N steps (a tick that ships to the aggregator) and after N more (a tick that seals the spool
batch), and the same two ticks with no step between them, which are taken off. The timed runs
above need the machine quiet enough that valgrind makes tens of steps a run; this does not.

``--annotate``: for the sampler thread, the C functions with the largest inclusive
instructions per second of training (``callgrind_annotate --inclusive=yes`` of the long and the
short run, differenced). CPython 3.11 shows Python code only as the interpreter's functions, so
this names the C calls the Python code makes (``os.stat``, file reads, msgspec encoding, time
formatting), not its lines. ``--profile`` adds the Python-level view: a native child with
cProfile on stepwatch's threads only (``threading.Thread.run`` wrapped), training for
``T2`` seconds; the functions by cumulative time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, load_average, machine_header, print_header, print_table, versions, write_results

SCRIPT = Path(__file__).resolve()
MODES = ("init", "run")
MLP = (16, 64, 2, 16)  # input features, hidden width, hidden layers, batch size
PASS = 32  # batches a pass over the loader
LEAD = 3  # ticks from init to the start of a run
SETTLE_S = 0.5  # after a tick began: it has ended (ticks are 1 s apart and take well under 0.5 s)
_THREAD_NAMES: list[str] = []  # Python threads started in this process, in order


def _note_thread_starts() -> None:
    """Wraps ``Thread.start`` to note each Python thread's name, in start order (a started
    thread's OS thread exists when ``start`` returns, so this is callgrind's order too)."""
    start = threading.Thread.start

    def noted(self: threading.Thread) -> None:
        _THREAD_NAMES.append(self.name)
        start(self)

    threading.Thread.start = noted  # type: ignore[method-assign]


# -- the workers -----------------------------------------------------------------------------------


def _workload() -> Any:
    import bench_training_overhead as overhead

    overhead.CONFIGS["sampler"] = MLP
    return overhead.Workload("sampler", PASS, None)  # no trace_step: steps inferred by the patches


class _TickWatch:
    """Counts the sampler's ticks from outside, on the training thread: each tick begins by
    writing its sign of life into the rank's step ledger (``alive_ns``, a fixed offset of the
    header, docs/crash-safety.md), so a change of those 8 bytes is a tick begun. One ``pread`` a
    poll; nothing of the sampler's is touched."""

    def __init__(self, run_dir: Path) -> None:
        from stepwatch.artifacts.step_ledger import HEADER, LEDGER_DIR

        paths = sorted((run_dir / LEDGER_DIR).glob(f"rank0-{os.getpid()}.steps"))
        if not paths:
            raise SystemExit(f"no step ledger in {run_dir}: the ticks cannot be counted")
        self._fd = os.open(paths[0], os.O_RDONLY)
        self._header = HEADER
        self.alive = self._alive()
        self.ticks = 0

    def _alive(self) -> int:
        return int(self._header.unpack(os.pread(self._fd, self._header.size, 0))[7])

    def poll(self) -> int:
        alive = self._alive()
        if alive != self.alive:
            self.alive = alive
            self.ticks += 1
        return self.ticks

    def wait(self, ticks: int) -> None:
        """Sleeps until tick ``ticks`` has begun, then half a period more: it has ended."""
        while self.poll() < ticks:
            time.sleep(0.01)
        time.sleep(SETTLE_S)

    def close(self) -> None:
        os.close(self._fd)


def _train(work: Any, done: Callable[[], bool]) -> int:
    """``Workload.plain``'s loop, passes over the loader until ``done()`` (asked after each step:
    under valgrind a step takes ~0.2 s); returns the steps made."""
    model, optimizer, loss_fn = work.model, work.optimizer, work.loss_fn
    steps = 0
    while True:
        for x, y in work.loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            steps += 1
            if done():
                return steps


def _start_aggregator(run_dir: Path) -> subprocess.Popen[str]:
    """``python -m stepwatch.server`` as ``stepwatch run`` starts it (native: valgrind does not
    follow an exec unless asked); the rank finds it through ``STEPWATCH_AGGREGATOR``."""
    command = [sys.executable, "-m", "stepwatch.server", "--out", str(run_dir), "--host", "127.0.0.1",
               "--port", "0", "--launched"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the aggregator did not start (exit code {proc.wait(10)})")
    host, _, port = json.loads(line)["tcp"].rpartition(":")
    os.environ.update(STEPWATCH_AGGREGATOR=f"127.0.0.1:{port}", STEPWATCH_LAUNCHER="run", STEPWATCH_RANK="0",
                      STEPWATCH_LOCAL_RANK="0", STEPWATCH_WORLD_SIZE="1")
    return proc


def _stop_aggregator(proc: subprocess.Popen[str]) -> None:
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _one_run(mode: str, train_ticks: int, idle_ticks: int, out: Path, requests: Any) -> dict[str, Any]:
    """One run in a fresh process: capture on, warm-up, [instrumentation on], train for
    ``train_ticks`` of the sampler's ticks, idle for ``idle_ticks`` more, stop capture."""
    import stepwatch

    _THREAD_NAMES.clear()  # a forked child has the forking thread only
    aggregator = _start_aggregator(out) if mode == "run" else None
    try:
        runtime = stepwatch.init(out=out)
        if not runtime.active or runtime.patches is None or not runtime.patches.installed:
            raise SystemExit("stepwatch did not start with its torch patches installed")
        if mode == "run" and runtime.sender is None:
            raise SystemExit("no aggregator connection: STEPWATCH_AGGREGATOR was not taken")
        work = _workload()
        watch = _TickWatch(out)
        # warm-up (torch's and the tool's lazy set-up), uninstrumented, until the LEAD-th tick:
        # every run then starts at the same tick of the sampler's schedule (seals every 2 s,
        # heartbeats and discovery every 5 s, counted from init), between two ticks
        _train(work, lambda: watch.poll() >= LEAD)
        watch.wait(LEAD)
        # every object so far out of the cyclic GC's reach: a full collection (~millions of
        # instructions over torch's objects) would otherwise land, by chance, on whichever
        # thread's allocation set it off, and move one run's count by more than a tick's work
        gc.freeze()
        if requests is not None:
            requests.start_instrumentation()
        started = time.monotonic()
        steps = _train(work, lambda: watch.poll() >= LEAD + train_ticks)
        trained = time.monotonic() - started
        watch.wait(LEAD + train_ticks + idle_ticks)  # the window: ticks LEAD+1 .. LEAD+train+idle, whole
        seconds = time.monotonic() - started
        watch.close()
        sent = runtime.sender.rows_sent if runtime.sender is not None else None
        stepwatch.shutdown()
    finally:
        if aggregator is not None:
            _stop_aggregator(aggregator)
    return {"pid": os.getpid(), "train_ticks": train_ticks, "idle_ticks": idle_ticks, "steps": steps, "trained_s": trained,
            "seconds": seconds, "threads": list(_THREAD_NAMES), "rows_sent": sent}


PER_STEP_WORKERS = tuple(f"per-step-{mode}" for mode in MODES)
PER_STEP_PARTS = ("idle ship", "idle seal", "train", "ship", "train", "seal")


def _ticks_by_hand(mode: str, steps: int, out: Path, requests: Any) -> dict[str, Any]:
    """The per-step part alone, exactly: capture on as ``mode`` says, the sampler thread stopped,
    and its tick run here, on the training thread, between known numbers of steps: a tick that
    ships (what the aggregator gets), ``steps`` steps, a tick that ships, ``steps`` more, a tick
    that seals the spool batch; and the same two ticks with no step between them first. One
    callgrind dump each (``PER_STEP_PARTS``): nothing else runs in them, and no tick's timing
    decides what it finds, so the count is the same from run to run."""
    import stepwatch

    aggregator = _start_aggregator(out) if mode == "run" else None
    try:
        runtime = stepwatch.init(out=out)
        if mode == "run" and runtime.sender is None:
            raise SystemExit("no aggregator connection: STEPWATCH_AGGREGATOR was not taken")
        runtime.sampler.stopping.set()  # no tick of its own from here on: this thread runs them
        runtime.sampler.thread.join()
        work = _workload()
        batches: Any = iter(())

        def train(count: int) -> None:
            nonlocal batches
            model, optimizer, loss_fn = work.model, work.optimizer, work.loss_fn
            for _ in range(count):
                batch = next(batches, None)
                if batch is None:
                    batches = iter(work.loader)
                    batch = next(batches)
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(batch[0]), batch[1]).backward()
                optimizer.step()

        def tick(seal: bool) -> None:  # each with a sample and a heartbeat, whatever time it is
            runtime._next_seal = 0.0 if seal else time.monotonic() + 3600.0
            runtime._next_sample = runtime._next_heartbeat = 0.0
            runtime.tick()

        for index in range(4):  # warm-up: every lazy set-up done, a spool batch and frames written
            train(steps)
            tick(index % 2 == 1)
        gc.freeze()
        requests.start_instrumentation()
        requests.dump("warm")
        tick(False)
        requests.dump(PER_STEP_PARTS[0])
        tick(True)
        requests.dump(PER_STEP_PARTS[1])
        for seal in (False, True):
            train(steps)
            requests.dump("train")
            tick(seal)
            requests.dump("seal" if seal else "ship")
        stepwatch.shutdown()
    finally:
        if aggregator is not None:
            _stop_aggregator(aggregator)
    return {"pid": os.getpid(), "steps": steps, "mode": mode}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=(*MODES, "native", "profile", *PER_STEP_WORKERS))
    parser.add_argument("--runs", nargs="+", required=True, help="TRAIN:IDLE ticks, one child each")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    _note_thread_starts()
    import bench_training_overhead as overhead

    overhead._torch_setup()  # one torch thread; torch before stepwatch.init: patches at init
    import stepwatch  # noqa: F401 - imported once, before the forks
    # one pass of the loop with no capture: valgrind translates torch's code once, here, and
    # every forked child inherits the translations (a child's own warm-up then takes seconds)
    _workload().plain()
    runs = [tuple(int(x) for x in spec.split(":")) for spec in args.runs]
    if args.worker == "native":
        train_ticks, idle_ticks = runs[0]
        result = _one_run("init", train_ticks, idle_ticks, args.out / "native", None)
        print(json.dumps({"steps_per_s": result["steps"] / result["trained_s"], **result}))
        return
    if args.worker == "profile":
        print(json.dumps(_profile(runs[0][0], args.out / "profile")))
        return
    from bench_step_instructions import _ClientRequests

    requests = _ClientRequests()
    if not requests.running_on_valgrind():
        raise SystemExit("the worker must run under valgrind --tool=callgrind (the parent starts it so)")
    if args.worker in PER_STEP_WORKERS:
        print(json.dumps(_ticks_by_hand(args.worker.removeprefix("per-step-"), runs[0][0], args.out / "per-step",
                                        requests)))
        return
    results = []
    for index, (train_ticks, idle_ticks) in enumerate(runs):
        result_file = args.out / f"run{index}.json"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                result = _one_run(args.worker, train_ticks, idle_ticks, args.out / f"run{index}", requests)
                result_file.write_text(json.dumps(result))
                code = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # valgrind writes the child's dump as it exits
        _, status = os.waitpid(pid, 0)
        if status != 0 or not result_file.exists():
            raise SystemExit(f"run {index} ({train_ticks}:{idle_ticks}) failed (wait status {status})")
        results.append(json.loads(result_file.read_text()))
    print(json.dumps({"mode": args.worker, "runs": results}))


def _profile(train_ticks: int, out: Path) -> dict[str, Any]:
    """cProfile of stepwatch's own threads (native), by cumulative CPU time of the thread (wall
    time would count the sampler's waits for the GIL): the Python-level view."""
    import cProfile
    import io
    import pstats

    profiles: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        if not self.name.startswith("stepwatch"):
            return run(self)
        profile = cProfile.Profile(time.thread_time)  # CPU time: not the waits for the GIL
        profiles.append(profile)
        profile.enable()
        try:
            return run(self)
        finally:
            profile.disable()

    threading.Thread.run = profiled  # type: ignore[method-assign]
    result = _one_run("init", train_ticks, 0, out, None)
    text = io.StringIO()
    if profiles:
        stats = pstats.Stats(profiles[0], stream=text)
        for profile in profiles[1:]:
            stats.add(profile)
        stats.sort_stats("cumulative").print_stats(r"stepwatch|psutil|msgspec|datetime|pathlib|genericpath", 30)
    return {**result, "listing": text.getvalue()}


# -- the parent ------------------------------------------------------------------------------------


_FINAL_PART = re.compile(r"callgrind\.out\.(\d+)-(\d+)$")  # the exit dump: callgrind.out.PID-THREAD


def thread_dumps(directory: Path, pid: int) -> dict[int, Path]:
    """The exit dump of one process, one file per callgrind thread id."""
    found: dict[int, Path] = {}
    for path in directory.glob(f"callgrind.out.{pid}-*"):
        match = _FINAL_PART.search(path.name)
        if match is not None and int(match.group(1)) == pid:
            found[int(match.group(2))] = path
    if not found:
        raise SystemExit(f"no callgrind dump of process {pid} in {directory}")
    return found


def _runs_python_thread(path: Path) -> bool:
    with path.open() as handle:
        # a name is written once, at its first use as fn= or cfn=, then only its number
        return any(line.startswith(("fn=", "cfn=")) and line.rstrip().endswith(" thread_run") for line in handle)


def name_threads(dumps: dict[int, Path], python_threads: list[str]) -> dict[int, str]:
    """callgrind thread id -> a name: ``training`` (thread 1), the Python threads by start order,
    ``other`` for threads started in C (torch's)."""
    names = {1: "training (main)"}
    pythons = [tid for tid in sorted(dumps) if tid != 1 and _runs_python_thread(dumps[tid])]
    for index, tid in enumerate(pythons):
        names[tid] = python_threads[index] if len(pythons) == len(python_threads) else f"python thread {index + 1}"
    for tid in dumps:
        names.setdefault(tid, f"other (C) thread {tid}")
    return names


def total_instructions(path: Path) -> int:
    with path.open() as handle:
        for line in handle:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    return 0  # a thread that ran nothing while instrumented


def solve(runs: list[dict[str, Any]], counts: list[float]) -> tuple[float, float, float]:
    """(a, b, c) of ``I = a * seconds + b * steps + c`` through the three runs (Cramer's rule)."""
    rows = [(run["seconds"], run["steps"], 1.0) for run in runs]

    def det(m: list[tuple[float, float, float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    whole = det(rows)
    if abs(whole) < 1e-9:
        raise SystemExit("the three runs do not separate time from steps (did the idle run train as much?)")
    out = []
    for col in range(3):
        m = [tuple(counts[i] if j == col else rows[i][j] for j in range(3)) for i in range(3)]
        out.append(det(m) / whole)  # type: ignore[arg-type]
    return out[0], out[1], out[2]


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / mode
    out.mkdir(parents=True)
    k1, k2 = args.ticks
    runs = [f"{k1}:0", f"{k2}:0", f"{k1}:{k2 - k1}"]
    # --fair-sched: valgrind runs one thread at a time, and by default the thread that lets go of
    # its lock takes it straight back: the training thread then kept the sampler from its ticks
    # for up to 10 s (the GIL handed over, but never the CPU)
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no", "--fair-sched=yes",
               f"--callgrind-out-file={out}/callgrind.out.%p", f"--log-file={out}/valgrind.%p.log",
               sys.executable, str(SCRIPT), "--worker", mode, "--runs", *runs, "--out", str(out)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    for name in [k for k in env if k.startswith("STEPWATCH_")]:
        env.pop(name)  # this bench says what capture sees
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=1800, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        for log in out.glob("valgrind.*.log"):
            sys.stderr.write(log.read_text()[-2000:])
        raise SystemExit(f"worker {mode} failed with exit status {proc.returncode}")
    result = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])
    per_thread: dict[str, dict[str, Any]] = {}
    for index, run in enumerate(result["runs"]):
        dumps = thread_dumps(out, run["pid"])
        names = name_threads(dumps, run["threads"])
        for tid, path in dumps.items():
            entry = per_thread.setdefault(names[tid], {"counts": [0, 0, 0], "files": [None, None, None]})
            entry["counts"][index] += total_instructions(path)
            entry["files"][index] = str(path)
    for entry in per_thread.values():
        a, b, c = solve(result["runs"], entry["counts"])
        short, long = result["runs"][0], result["runs"][1]
        entry.update(per_second_idle=a, per_step=b, fixed=c,
                     two_lengths=(entry["counts"][1] - entry["counts"][0]) / (long["seconds"] - short["seconds"]))
    return {"runs": result["runs"], "threads": per_thread, "wall_s": time.perf_counter() - started}


def native_rate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = dict(os.environ)
    for name in [k for k in env if k.startswith("STEPWATCH_")]:
        env.pop(name)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--worker", "native", "--runs", f"{args.native_ticks}:0",
                           "--out", str(work)], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600,
                          check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit("the native rate run failed")
    return json.loads(proc.stdout.splitlines()[-1])


def per_step(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``_ticks_by_hand`` under callgrind: the sampler's instructions per training step, from
    the dumps of the main thread (where the ticks ran)."""
    out = work / f"per-step-{mode}"
    out.mkdir(parents=True)
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
               f"--callgrind-out-file={out}/callgrind.out.%p", f"--log-file={out}/valgrind.%p.log",
               sys.executable, str(SCRIPT), "--worker", f"per-step-{mode}", "--runs", f"{args.per_step}:0",
               "--out", str(out)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    for name in [k for k in env if k.startswith("STEPWATCH_")]:
        env.pop(name)
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=3600, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"per-step worker {mode} failed with exit status {proc.returncode}")
    pid = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])["pid"]
    parts: dict[str, int] = {}
    for path in out.glob(f"callgrind.out.{pid}.*-01"):  # the main thread's dumps, by their label
        text = path.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        if label is not None and label.group(1) in PER_STEP_PARTS and label.group(1) != "train":
            parts[label.group(1)] = parts.get(label.group(1), 0) + total_instructions(path)
    if set(parts) != {"idle ship", "idle seal", "ship", "seal"}:
        raise SystemExit(f"per-step worker {mode}: dumps {sorted(parts)} in {out}")
    steps = 2 * args.per_step
    return {"parts": parts, "steps": steps,
            "per_step": (parts["ship"] + parts["seal"] - parts["idle ship"] - parts["idle seal"]) / steps}


def print_annotation(mode: str, result: dict[str, Any], rows: int = 25) -> None:
    sampler = next((e for name, e in result["threads"].items() if name.startswith("stepwatch-sampler")), None)
    if sampler is None or None in sampler["files"][:2]:
        print(f"\n{mode}: no sampler thread dump to annotate")
        return
    from bench_step_instructions import callgrind_costs

    short, long = (callgrind_costs(Path(f), inclusive=True) for f in sampler["files"][:2])
    seconds = result["runs"][1]["seconds"] - result["runs"][0]["seconds"]
    diff = {k: (long.get(k, 0) - short.get(k, 0)) / seconds for k in set(short) | set(long)}
    top = sorted(diff.items(), key=lambda kv: kv[1], reverse=True)[:rows]
    print(f"\n{mode}: sampler thread, inclusive instructions per second of training (valgrind pace), largest")
    print_table(["function (file:name)", "per second"], [[k, f"{v:,.0f}"] for k, v in top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: init run")
    parser.add_argument("--ticks", type=int, nargs=2, default=[5, 15], metavar=("K1", "K2"),
                        help="sampler ticks (about seconds) of training of the short and the long run "
                             "(default 5 15); the idle run trains K1 then idles K2 - K1")
    parser.add_argument("--native-ticks", type=int, default=3, help="ticks of the native rate run (default 3)")
    parser.add_argument("--rate", type=float, default=None,
                        help="steps per second of native training to project to (default: measured; give the "
                             "same one to compare two versions)")
    parser.add_argument("--annotate", action="store_true", help="the sampler's largest C functions per second")
    parser.add_argument("--per-step", type=int, default=0, metavar="N",
                        help="also the per-step part exactly: the ticks run by hand between N and N steps "
                             "(callgrind, no timing involved; N=300 takes a few minutes a mode)")
    parser.add_argument("--profile", action="store_true", help="cProfile of stepwatch's threads, natively")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where callgrind's files and the run directories go (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep callgrind's files (the path is printed)")
    args = parser.parse_args()
    if not 0 < args.ticks[0] < args.ticks[1]:
        parser.error("--ticks K1 K2 needs 0 < K1 < K2")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")

    header = machine_header(args.tmp_dir)
    header["versions"] = versions("stepwatch", "torch", "psutil", "msgspec")
    header["valgrind"] = subprocess.run(["valgrind", "--version"], capture_output=True, text=True,
                                        check=False).stdout.strip()
    print_header("capture's background threads in instructions per second of training (callgrind)", header)
    f, h, d, b = MLP
    print(f"loop: MLP {f}->{h}x{d}->10 (ReLU) on CPU, batch {b}, SGD momentum, cross-entropy, DataLoader "
          f"(num_workers=0), torch threads 1, steps inferred (no trace_step); stepwatch.init() defaults")
    k1, k2 = args.ticks
    print(f"runs per mode, from the sampler's tick {LEAD} after init: train {k1} ticks, train {k2} ticks, train {k1} "
          f"ticks + idle {k2 - k1} ticks (a tick: about 1 s); {header['valgrind']} --separate-threads=yes\n")
    work = Path(tempfile.mkdtemp(prefix="bench-sampler-instructions-", dir=args.tmp_dir))
    results: dict[str, Any] = {}
    exact: dict[str, Any] = {}
    try:
        print(f"native step rate ... (load average {load_average()})", flush=True)
        native = native_rate(args, work / "native")
        print(f"  {native['steps_per_s']:,.0f} steps/s with capture on ({native['steps']} steps in "
              f"{native['trained_s']:.2f} s)")
        rate = args.rate or native["steps_per_s"]
        for mode in args.modes:
            print(f"running {mode} under callgrind ... (load average {load_average()})", flush=True)
            results[mode] = run_mode(mode, args, work)
            for run in results[mode]["runs"]:
                print(f"  train {run['train_ticks']} + idle {run['idle_ticks']} ticks: {run['steps']} steps in "
                      f"{run['trained_s']:.1f} s ({run['steps'] / run['trained_s']:.0f}/s), {run['seconds']:.1f} s "
                      f"in all; Python threads {run['threads']}")
        if args.per_step:
            for mode in args.modes:
                print(f"running {mode} with the ticks by hand ... (load average {load_average()})", flush=True)
                try:
                    exact[mode] = per_step(mode, args, work)
                except SystemExit as failure:  # the timed modes' figures still get printed
                    print(f"  the ticks by hand failed: {failure}", flush=True)
        if args.annotate:
            for mode, result in results.items():
                print_annotation(mode, result)
        if args.profile:
            print(f"\ncProfile of stepwatch's threads (CPU time), native, {k2} ticks of training:")
            profile = subprocess.run([sys.executable, str(SCRIPT), "--worker", "profile", "--runs",
                                      f"{k2}:0", "--out", str(work / "profile")], capture_output=True,
                                     text=True, cwd=REPO_ROOT, timeout=600, check=False)
            if profile.returncode != 0:
                sys.stderr.write(profile.stdout + profile.stderr)
            else:
                done = json.loads(profile.stdout.splitlines()[-1])
                print(f"({done['steps']} steps in {done['trained_s']:.1f} s)\n{done['listing']}")
    finally:
        if args.keep:
            print(f"\ncallgrind files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    rows = []
    for mode, result in results.items():
        for name, entry in sorted(result["threads"].items()):
            if name.startswith("other") and max(entry["counts"]) == 0:
                continue
            native_per_s = entry["per_second_idle"] + entry["per_step"] * rate
            entry["per_second_native"] = native_per_s
            rows.append([mode, name, f"{entry['per_second_idle']:,.0f}", f"{entry['per_step']:,.0f}",
                         f"{native_per_s:,.0f}", f"{entry['two_lengths']:,.0f}", f"{entry['fixed']:,.0f}"])
    print_table(["mode", "thread", "instr/s, time alone (a)", "instr/step (b)",
                 f"instr/s of training at {rate:,.0f} steps/s", "instr/s, K2-K1 under valgrind", "start+stop (c)"],
                rows)
    print("\nI = a * seconds + b * steps + c per thread, solved through the three runs; 'of training' = a + b * "
          "(native steps/s with capture on, or --rate). The training thread's a and b are the program's own work and the "
          "patches' (bench_step_instructions.py measures those).")
    if exact:
        print(f"\nthe per-step part exactly (ticks run by hand on the training thread, {args.per_step} steps "
              "between them): instructions a step, the ticks' own cost without steps taken off")
        print_table(["mode", "ship tick", "seal tick", "instr/step", f"x {rate:,.0f} steps/s"],
                    [[mode, f"{e['parts']['ship']:,}", f"{e['parts']['seal']:,}", f"{e['per_step']:,.0f}",
                      f"{e['per_step'] * rate:,.0f}"] for mode, e in exact.items()])
    header["load_average_at_end"] = load_average()
    path = write_results("sampler_instructions", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                                  "native": {k: v for k, v in native.items() if k != "listing"},
                                                  "results": results, "per_step": exact})
    print(f"raw results: {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[1:])
    else:
        main()
