"""What the launcher itself costs: ``stepwatch run`` and ``traceml run`` on a trivial script
against plain ``python``, and the memory of every process they add.

Usage::

    .venv/bin/python bench/bench_launcher.py [--repeat 5] [--traceml-repeat 3] [--sleep 3]
        [--no-traceml] [--tmp-dir DIR] [--profile]

1. **Wall time** of ``python trivial.py`` (``print("hi")``), ``stepwatch run trivial.py`` and
   ``traceml run trivial.py`` (summary mode, its default; ``--aggregator-port`` set to a free
   port, a fresh ``--run-name`` under a temp ``--logs-dir``), interleaved round by round so a
   load change hits every contender alike; best and median of ``--repeat`` runs
   (``--traceml-repeat`` for TraceML, ~15-25 s a run here). Each run must exit 0 and print ``hi``.
2. **Where stepwatch's seconds go**: the same trivial script with stepwatch's capture
   autostarted exactly as ``stepwatch run`` starts it in the training process
   (``sitecustomize`` on ``PYTHONPATH``, ``STEPWATCH_AUTOSTART=1``), but without an aggregator;
   ``python -m stepwatch.server`` until its ready line (then SIGTERM, timed to exit); and
   ``stepwatch --version`` (the CLI's own imports). Best of ``--repeat``.
3. **Memory of every process**: each launcher runs ``sleeper.py`` (``time.sleep(--sleep)``);
   the parent samples the whole process tree with psutil every 0.1 s and keeps each process's
   peak RSS, its role (launcher, aggregator, torchrun agent, training), and whether
   ``/proc/<pid>/maps`` ever showed torch's shared libraries. "Added" is the sum over the
   launcher's extra processes plus the training process's RSS above plain ``python sleeper.py``.
4. **Does the aggregator import torch**: ``python -X importtime -m stepwatch.server`` (and
   TraceML's ``aggregator_main.py``) started until ready: RSS, torch in ``/proc/<pid>/maps``,
   modules imported, whether any of them is torch or numpy, the slowest top-level imports.

``--profile`` adds a cProfile of the ``stepwatch run trivial.py`` launcher process (where its
own wall time goes: imports, waiting for the aggregator's ready line, for the training
process, for the aggregator to stop, the final summary).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO_ROOT,
    load_average,
    machine_header,
    print_header,
    print_table,
    write_results,
)

PYTHON = sys.executable
BIN = Path(sys.executable).parent
TARGET_ADDED_S = 1.5
TARGET_AGGREGATOR_MIB = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traceml_main() -> Path | None:
    try:
        import traceml_ai
    except ImportError:
        return None
    path = Path(traceml_ai.__file__).resolve().parent / "aggregator" / "aggregator_main.py"
    return path if path.exists() else None


def autostart_dir() -> Path:
    import stepwatch

    return Path(stepwatch.__file__).resolve().parent / "capture" / "_autostart"


class Commands:
    """The command line of each contender for a script, each run in a fresh output directory."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.n = 0

    def next_dir(self, prefix: str) -> Path:
        self.n += 1
        return self.work / f"{prefix}-{self.n}"

    def python(self, script: Path) -> tuple[list[str], dict[str, str]]:
        return [PYTHON, str(script)], {}

    def stepwatch(self, script: Path) -> tuple[list[str], dict[str, str]]:
        return [str(BIN / "stepwatch"), "run", "--out", str(self.next_dir("sw")), str(script)], {}

    def traceml(self, script: Path) -> tuple[list[str], dict[str, str]]:
        return [str(BIN / "traceml"), "run", "--logs-dir", str(self.work / "traceml-logs"),
                "--run-name", f"r{self.next_dir('tm').name}", "--aggregator-port", str(free_port()),
                str(script)], {}

    def autostart(self, script: Path) -> tuple[list[str], dict[str, str]]:
        """The training process as `stepwatch run` starts it, without an aggregator to ship to."""
        run_dir = self.next_dir("auto")
        run_dir.mkdir(parents=True)
        env = {"STEPWATCH_AUTOSTART": "1", "STEPWATCH_RUN_DIR": str(run_dir), "STEPWATCH_LAUNCHER": "run",
               "STEPWATCH_RANK": "0", "STEPWATCH_LOCAL_RANK": "0", "STEPWATCH_WORLD_SIZE": "1",
               "STEPWATCH_INTERVAL_MS": "1000",
               "PYTHONPATH": os.pathsep.join(p for p in (str(autostart_dir()), os.environ.get("PYTHONPATH")) if p)}
        return [PYTHON, str(script)], env

    def cli_version(self, script: Path) -> tuple[list[str], dict[str, str]]:
        return [str(BIN / "stepwatch"), "--version"], {}


def timed_run(command: list[str], env: dict[str, str], expect: str | None, timeout: float = 300) -> float:
    started = time.perf_counter()
    proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0 or (expect is not None and expect not in proc.stdout):
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    return elapsed


def aggregator_ready_and_stop(work: Path, importtime: bool = False) -> dict[str, Any]:
    """``python -m stepwatch.server`` until its ready line; RSS and torch there; then SIGTERM."""
    import psutil

    out = work / f"agg-{time.perf_counter_ns()}"
    command = [PYTHON, *(["-X", "importtime"] if importtime else []), "-m", "stepwatch.server", "--out", str(out)]
    err_path = work / f"{out.name}.stderr"
    with err_path.open("w") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO_ROOT)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        ready_s = time.perf_counter() - started
        if not line:
            raise RuntimeError(f"aggregator did not start: {err_path.read_text()[-2000:]}")
        time.sleep(0.5)  # settled: the write loop has ticked
        p = psutil.Process(proc.pid)
        rss = p.memory_info().rss
        uss = p.memory_full_info().uss
        torch = maps_has_torch(proc.pid)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        stop_s = time.perf_counter() - t0
    return {"ready_s": ready_s, "stop_s": stop_s, "rss": rss, "uss": uss, "torch_in_maps": torch,
            "stderr": err_path.read_text() if importtime else ""}


def traceml_aggregator_ready(work: Path, importtime: bool = False) -> dict[str, Any] | None:
    """TraceML's aggregator_main.py (summary mode, port 0) until its ready line on stderr."""
    import psutil

    main = traceml_main()
    if main is None:
        return None
    root = work / f"tm-agg-{time.perf_counter_ns()}"
    root.mkdir(parents=True)
    env = {**os.environ, "TRACEML_UI_MODE": "summary", "TRACEML_AGGREGATOR_PORT": "0",
           "TRACEML_LOGS_DIR": str(root / "logs"), "TRACEML_SESSION_ID": "bench"}
    err_path = root / "stderr"
    with err_path.open("w") as err, (root / "stdout").open("w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([PYTHON, *(["-X", "importtime"] if importtime else []), str(main)], env=env,
                                stdout=out, stderr=err, cwd=root)
        while "Aggregator ready on" not in err_path.read_text():
            if proc.poll() is not None or time.perf_counter() - started > 120:
                proc.kill()
                return {"error": err_path.read_text()[-2000:]}
            time.sleep(0.02)
        ready_s = time.perf_counter() - started
        time.sleep(0.5)
        p = psutil.Process(proc.pid)
        rss = p.memory_info().rss
        uss = p.memory_full_info().uss
        torch = maps_has_torch(proc.pid)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stop_s = time.perf_counter() - t0
    return {"ready_s": ready_s, "stop_s": stop_s, "rss": rss, "uss": uss, "torch_in_maps": torch,
            "stderr": err_path.read_text() if importtime else ""}


def maps_has_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as handle:
            return any("/torch/" in line for line in handle)
    except OSError:
        return False


def parse_importtime(stderr: str) -> dict[str, Any]:
    """``-X importtime`` lines: module count, torch/numpy, the slowest top-level imports (cumulative)."""
    modules = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            modules.append((m.group(4), int(m.group(1)), int(m.group(2)), len(m.group(3))))
    names = {name for name, *_ in modules}
    top = sorted((m for m in modules if m[3] <= 1), key=lambda m: -m[2])[:6]
    return {"modules": len(modules), "torch": any(n == "torch" or n.startswith("torch.") for n in names),
            "numpy": any(n == "numpy" or n.startswith("numpy.") for n in names),
            "total_s": sum(m[1] for m in modules) / 1e6,
            "slowest_top_level": [(name, cum / 1e6) for name, _, cum, _ in top]}


# -- memory of a process tree -------------------------------------------------------------------


def role_of(cmdline: list[str], root: bool) -> str:
    text = " ".join(cmdline)
    if root:
        return "launcher"
    if "stepwatch.server" in text or "aggregator_main.py" in text:
        return "aggregator"
    if "torch.distributed.run" in text or "torchrun" in text:
        return "torchrun agent"
    if "sleeper.py" in text or "traceml_ai/runtime/executor.py" in text:
        return "training"
    return "other: " + text[:60]


def tree_memory(command: list[str], env: dict[str, str], period: float = 0.1) -> dict[str, Any]:
    """Runs ``command``, sampling its whole process tree; per process: role, peak RSS, torch."""
    import psutil

    procs: dict[int, dict[str, Any]] = {}
    started = time.perf_counter()
    proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=REPO_ROOT)
    stderr_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for member in members:
            try:
                rss = member.memory_info().rss
                entry = procs.get(member.pid)
                if entry is None:
                    cmd = member.cmdline()
                    if not cmd:
                        continue
                    entry = procs[member.pid] = {"pid": member.pid, "cmdline": cmd,
                                                 "role": role_of(cmd, member.pid == proc.pid),
                                                 "rss_max": 0, "torch": False, "samples": 0}
                entry["rss_max"] = max(entry["rss_max"], rss)
                entry["samples"] += 1
                if not entry["torch"] and entry["samples"] % 3 == 1:
                    entry["torch"] = maps_has_torch(member.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(period)
    wall = time.perf_counter() - started
    reader.join(5)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {''.join(stderr_chunks)[-2000:]}")
    return {"wall_s": wall, "processes": sorted(procs.values(), key=lambda e: e["pid"])}


# -- the profile --------------------------------------------------------------------------------


def profile_launcher(commands: Commands, script: Path) -> str:
    import pstats

    out = commands.work / "launcher.prof"
    run_dir = commands.next_dir("swprof")
    started = time.perf_counter()
    subprocess.run([PYTHON, "-m", "cProfile", "-o", str(out), str(BIN / "stepwatch"), "run", "--out", str(run_dir),
                    str(script)], check=True, capture_output=True, cwd=REPO_ROOT)
    wall = time.perf_counter() - started
    stats = pstats.Stats(str(out))
    wanted = ("launch", "_start_aggregator", "write_run_manifest", "_close_rank_sessions", "write_final_summary",
              "build_summary", "render_summary_text", "wait", "readline", "_find_and_load", "main", "invoke")
    lines = [f"cProfile of `stepwatch run trivial.py` (the launcher process; {wall:.2f} s wall with the profiler):",
             f"{'cumulative s':>12}  {'calls':>6}  function"]
    rows = []
    for (filename, lineno, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if name in wanted and ("stepwatch" in filename or "subprocess" in filename or "importlib" in filename
                               or name == "invoke"):
            rows.append((ct, nc, f"{Path(filename).name}:{lineno}({name})"))
        elif name == "readline" and "~" in filename:
            rows.append((ct, nc, "{method readline}"))
    for ct, nc, label in sorted(rows, reverse=True)[:14]:
        lines.append(f"{ct:12.3f}  {nc:>6}  {label}")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--traceml-repeat", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=3.0, help="seconds the memory run's script sleeps")
    parser.add_argument("--no-traceml", dest="traceml", action="store_false")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    header = machine_header(args.tmp_dir)
    print_header(f"launcher cost: python vs stepwatch run vs traceml run on a trivial script, "
                 f"best of {args.repeat} ({args.traceml_repeat} for TraceML)", header)
    work = Path(tempfile.mkdtemp(prefix="bench-launcher-", dir=args.tmp_dir))
    trivial = work / "trivial.py"
    trivial.write_text('print("hi")\n')
    sleeper = work / "sleeper.py"
    sleeper.write_text(f'import time\ntime.sleep({args.sleep})\nprint("hi")\n')
    commands = Commands(work)
    results: dict[str, Any] = {}
    traceml_ok = args.traceml and traceml_main() is not None
    try:
        # 1 + 2: wall times, interleaved
        contenders = {"python trivial.py": (commands.python, "hi"),
                      "stepwatch run trivial.py": (commands.stepwatch, "hi"),
                      "python trivial.py, stepwatch capture autostarted (no aggregator)": (commands.autostart, "hi"),
                      "stepwatch --version (CLI start-up)": (commands.cli_version, None)}
        if traceml_ok:
            contenders["traceml run trivial.py"] = (commands.traceml, "hi")
        times: dict[str, list[float]] = {name: [] for name in contenders}
        short = dict(zip(contenders, ("python", "stepwatch-run", "autostart", "cli", "traceml-run")))
        aggregator_runs: list[dict[str, Any]] = []
        traceml_errors: list[str] = []
        print("wall times ...", flush=True)
        for round_ in range(max(args.repeat, args.traceml_repeat)):
            for name, (build, expect) in contenders.items():
                limit = args.traceml_repeat if name.startswith("traceml") else args.repeat
                if round_ >= limit:
                    continue
                command, env = build(trivial)
                try:
                    times[name].append(timed_run(command, env, expect))
                except RuntimeError as exc:
                    if not name.startswith("traceml"):
                        raise
                    traceml_errors.append(str(exc))
            if round_ < args.repeat:
                aggregator_runs.append(aggregator_ready_and_stop(work))
            print(f"  round {round_ + 1}: " + ", ".join(f"{short[n]} {t[-1]:.2f}" for n, t in times.items()
                                                        if len(t) > round_), flush=True)
        results["wall"] = {n: {"times_s": t, "best_s": min(t) if t else None,
                               "median_s": statistics.median(t) if t else None} for n, t in times.items()}
        results["aggregator_alone"] = {
            "ready_s": [r["ready_s"] for r in aggregator_runs], "stop_s": [r["stop_s"] for r in aggregator_runs],
            "rss": [r["rss"] for r in aggregator_runs], "uss": [r["uss"] for r in aggregator_runs]}
        if traceml_errors:
            results["traceml_errors"] = traceml_errors
        # 3: memory of every process
        print("process trees ...", flush=True)
        trees = {"python sleeper.py": tree_memory(*commands.python(sleeper)),
                 "stepwatch run sleeper.py": tree_memory(*commands.stepwatch(sleeper))}
        if traceml_ok:
            try:
                trees["traceml run sleeper.py"] = tree_memory(*commands.traceml(sleeper))
            except RuntimeError as exc:
                results.setdefault("traceml_errors", []).append(str(exc))
        results["trees"] = trees
        # 4: imports of the aggregators
        print("aggregator imports ...", flush=True)
        sw = aggregator_ready_and_stop(work, importtime=True)
        results["import_stepwatch_server"] = {**{k: v for k, v in sw.items() if k != "stderr"},
                                              **parse_importtime(sw["stderr"])}
        if traceml_ok:
            tm = traceml_aggregator_ready(work, importtime=True)
            if tm is not None and "error" not in tm:
                results["import_traceml_aggregator"] = {**{k: v for k, v in tm.items() if k != "stderr"},
                                                        **parse_importtime(tm["stderr"])}
            tm2 = traceml_aggregator_ready(work)
            if tm2 is not None and "error" not in tm2:
                results["traceml_aggregator_alone"] = {k: v for k, v in tm2.items() if k != "stderr"}
        if args.profile:
            print("profile ...", flush=True)
            results["profile"] = profile_launcher(commands, trivial)
    finally:
        if args.keep_data:
            print(f"data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    report(results, args)
    header["load_average_at_end"] = load_average()
    print(f"load average at end: {header['load_average_at_end']}")
    path = write_results("launcher", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                      "results": results})
    print(f"raw results: {path}")


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    wall = results["wall"]
    base = wall["python trivial.py"]
    rows = []
    for name, w in wall.items():
        if w["best_s"] is None:
            rows.append([name, "failed", "-", "-", "-", "-"])
            continue
        rows.append([name, len(w["times_s"]), f"{w['best_s']:.3f}", f"{w['median_s']:.3f}",
                     f"{w['best_s'] - base['best_s']:+.3f}", f"{w['median_s'] - base['median_s']:+.3f}"])
    agg = results["aggregator_alone"]
    rows.append(["python -m stepwatch.server until its ready line", len(agg["ready_s"]), f"{min(agg['ready_s']):.3f}",
                 f"{statistics.median(agg['ready_s']):.3f}", "", ""])
    rows.append(["  ... then SIGTERM until it exits", len(agg["stop_s"]), f"{min(agg['stop_s']):.3f}",
                 f"{statistics.median(agg['stop_s']):.3f}", "", ""])
    tma = results.get("traceml_aggregator_alone")
    if tma:
        rows.append(["TraceML aggregator_main.py until ready (once)", 1, f"{tma['ready_s']:.3f}", "", "", ""])
        rows.append(["  ... then SIGTERM until it exits", 1, f"{tma['stop_s']:.3f}", "", "", ""])
    print("Wall time (seconds)")
    print_table(["command", "runs", "best", "median", "added (best)", "added (median)"], rows)
    print()
    for name, tree in results["trees"].items():
        print(f"{name}: {tree['wall_s']:.2f} s wall, {len(tree['processes'])} processes")
    base_training = max(e["rss_max"] for e in results["trees"]["python sleeper.py"]["processes"])
    rows = []
    for name, tree in results["trees"].items():
        extra = 0
        for e in tree["processes"]:
            is_training = e["role"] == "training"
            added = e["rss_max"] - base_training if is_training else e["rss_max"]
            if name != "python sleeper.py":
                extra += added
            rows.append([name.split(" sleeper")[0], e["role"], e["pid"], mib(e["rss_max"]),
                         f"{added / 2**20:+.1f}" if is_training else mib(e["rss_max"]),
                         "yes" if e["torch"] else "no", " ".join(e["cmdline"])[:70]])
        if name != "python sleeper.py":
            rows.append([name.split(" sleeper")[0], "ADDED IN ALL", "", "", mib(extra), "", ""])
    print(f"Peak RSS of every process (sampled every 0.1 s; 'added' for the training process is its RSS above plain "
          f"python's {mib(base_training)} MiB)")
    print_table(["launcher", "role", "pid", "RSS MiB", "added MiB", "torch", "command"], rows)
    print()
    rows = []
    for key, label in (("import_stepwatch_server", "python -X importtime -m stepwatch.server"),
                       ("import_traceml_aggregator", "python -X importtime traceml .../aggregator_main.py")):
        r = results.get(key)
        if r is None:
            continue
        slow = ", ".join(f"{n} {s:.2f}" for n, s in r["slowest_top_level"][:4])
        rows.append([label, f"{r['ready_s']:.2f}", mib(r["rss"]), mib(r["uss"]), r["modules"],
                     "yes" if r["torch"] or r["torch_in_maps"] else "no", "yes" if r["numpy"] else "no", slow])
    print("The aggregator process alone, until ready (importtime adds its own overhead to 'ready s'); slowest "
          "top-level imports in cumulative seconds")
    print_table(["process", "ready s", "RSS MiB", "USS MiB", "modules", "torch", "numpy", "slowest imports"], rows)
    print()
    if "profile" in results:
        print(results["profile"])
        print()
    for err in results.get("traceml_errors", []):
        print(f"TraceML failed: {err[:500]}")
    sw = wall["stepwatch run trivial.py"]
    added = sw["median_s"] - base["median_s"]
    print(f"Target: stepwatch run adds < {TARGET_ADDED_S} s to a trivial script: "
          f"{'met' if added < TARGET_ADDED_S else 'NOT MET'} (+{added:.3f} s median, "
          f"+{sw['best_s'] - base['best_s']:.3f} s best)")
    agg_proc = [e for e in results["trees"]["stepwatch run sleeper.py"]["processes"] if e["role"] == "aggregator"]
    imp = results["import_stepwatch_server"]
    if agg_proc:
        rss = agg_proc[0]["rss_max"]
        ok = rss < TARGET_AGGREGATOR_MIB * 2**20 and not agg_proc[0]["torch"] and not imp["torch"]
        print(f"Target: the aggregator imports no torch and stays under {TARGET_AGGREGATOR_MIB} MB RSS: "
              f"{'met' if ok else 'NOT MET'} ({mib(rss)} MiB peak in the run, torch "
              f"{'loaded' if agg_proc[0]['torch'] or imp['torch'] else 'not loaded'}; numpy "
              f"{'imported' if imp['numpy'] else 'not imported'})")
    tm = wall.get("traceml run trivial.py")
    if tm and tm["median_s"]:
        print(f"TraceML run adds +{tm['median_s'] - base['median_s']:.2f} s median; stepwatch run is "
              f"{(tm['median_s'] - base['median_s']) / added:.0f}x cheaper in added seconds")


if __name__ == "__main__":
    main()
