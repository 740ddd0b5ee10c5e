"""Footprint of the capture runtime in a process without torch: resident memory, import cost and
CPU use while idle, stepwatch against Stormlog 0.4.3's ``CPUMemoryTracker``.

Usage::

    .venv/bin/python bench/bench_capture_footprint.py [--rss-repeat N] [--cpu-seconds S]
                                                     [--cpu-parallel P] [--tmp-dir DIR]

Every figure comes from a fresh ``python -c`` child that imports only ``os sys time json
resource`` before it measures (not ``bench/_common.py``, whose imports would hide the
contender's), reads its own RSS from ``/proc/self/statm`` and its CPU time from
``getrusage(RUSAGE_SELF)`` (all threads):

  * RSS: the child imports the contender, starts it (``stepwatch.init(out=DIR, interval=1.0)``,
    or ``CPUMemoryTracker(sampling_interval=1.0[, telemetry_sink_config=...]).start_tracking()``),
    runs 2 s, reads RSS. "added" = that minus a bare child's RSS after the same 2 s (median of
    ``N`` children each); the import-only rows read RSS right after the import, against the bare
    child's RSS at start-up. One row first fills stepwatch's bounded tables (100,000 phase pairs
    and progress calls, faster than its sampler drains them): the worst case of its in-memory rows.
  * Import: wall time of ``python -c "import stepwatch"`` (and of loading the runtime's modules)
    minus ``python -c pass``, best of 10; modules each child loaded; whether torch or numpy came in.
  * CPU: the child starts the runtime at 1 Hz or 10 Hz, settles 2 s, then sleeps ``S`` s
    (default 10) and reports CPU seconds in that window as % of one core. Children of one
    contender run ``P`` at a time (default 2): they sleep, so they do not compete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO_ROOT,
    load_average,
    machine_header,
    print_header,
    print_table,
    versions,
    write_results,
)

TARGET_RSS_MB = 30.0
MB = 1_000_000  # the "30 MB"; MiB figures are printed too

# The child: argv = out_dir interval settle_s window_s. {imports}/{start}/{stop} are filled in.
CHILD = r'''
import json, os, resource, sys, time

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def hwm():
    # VmHWM: this process's own high-water mark (ru_maxrss also counts the parent's pages
    # before exec, since the kernel keeps the larger of the two across it)
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0

def usage():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_nvcsw, u.ru_nivcsw

out_dir, interval, settle_s, window_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
modules_0 = set(sys.modules)
rss_0 = rss()
t_0 = time.perf_counter()
{imports}
t_1 = time.perf_counter()
rss_imported = rss()
modules_imported = len(set(sys.modules) - modules_0)
extra = {{}}
{start}
t_2 = time.perf_counter()
import threading
threads = threading.active_count()
time.sleep(settle_s)
rss_settled = rss()
{settled}
cpu_0, vcsw_0, ivcsw_0 = usage()
w_0 = time.perf_counter()
if window_s:
    time.sleep(window_s)
w_1 = time.perf_counter()
cpu_1, vcsw_1, ivcsw_1 = usage()
rss_end = rss()
loaded = set(sys.modules) - modules_0
t_3 = time.perf_counter()
{stop}
t_4 = time.perf_counter()
print(json.dumps({{
    "rss_start_bytes": rss_0, "rss_imported_bytes": rss_imported, "rss_settled_bytes": rss_settled,
    "rss_end_bytes": rss_end,
    "rss_peak_bytes": hwm(),
    "import_s": t_1 - t_0, "start_s": t_2 - t_1, "stop_s": t_4 - t_3,
    "modules_after_import": modules_imported, "modules_loaded": len(loaded),
    "top_level_packages": sorted({{m.split(".")[0] for m in loaded}}),
    "torch_loaded": "torch" in sys.modules, "numpy_loaded": "numpy" in sys.modules,
    "psutil_loaded": "psutil" in sys.modules,
    "threads": threads, "window_s": w_1 - w_0, "cpu_s": cpu_1 - cpu_0,
    "voluntary_switches": vcsw_1 - vcsw_0, "involuntary_switches": ivcsw_1 - ivcsw_0, "extra": extra,
}}), flush=True)
{after}
'''

_STORMLOG_IMPORTS = (
    "from pathlib import Path\n"
    "from stormlog.cpu_profiler import CPUMemoryTracker\n"
    "from stormlog.telemetry_sink import TelemetrySinkConfig"
)

_STEPWATCH_START = (
    "_t = time.perf_counter()\n"
    "init = stepwatch.init  # the first attribute access loads the runtime's modules\n"
    "extra['load_modules_s'] = time.perf_counter() - _t\n"
    "_t = time.perf_counter()\n"
    "runtime = init(out=out_dir, interval=interval)\n"
    "extra['init_call_s'] = time.perf_counter() - _t\n"
    "assert runtime.active\n"
)


class Contender(NamedTuple):
    label: str
    imports: str
    start: str = ""
    stop: str = ""
    settled: str = ""  # runs right after the RSS reading
    after: str = ""  # runs after the result is printed


CONTENDERS: dict[str, Contender] = {
    "bare": Contender("bare interpreter", ""),
    "stepwatch": Contender("stepwatch init", "import stepwatch", _STEPWATCH_START, "stepwatch.shutdown()"),
    # Fill both bounded tables (``table_rows`` each) faster than the sampler drains, with a
    # fresh float per progress row as a real loss would be; RSS is read right after the loop
    # (tables full) and the high-water mark at the end covers the drain that follows.
    # The child then exits without ``shutdown`` (bench_capture_overhead.py times a shutdown).
    "stepwatch-full": Contender(
        "stepwatch init, tables full",
        "import stepwatch",
        _STEPWATCH_START + "for i in range(100_000):\n"
        "    with stepwatch.phase('step'):\n"
        "        stepwatch.progress(i, loss=i * 0.5)\n"
        "extra['rss_full_bytes'] = rss()\n"
        "extra['rows_queued_at_fill'] = len(runtime.phase_rows) + len(runtime.progress_rows)\n"
        "extra['table_rows'] = runtime.config.table_rows",
        settled="extra['rows_queued'] = len(runtime.phase_rows) + len(runtime.progress_rows)",
        after="os._exit(0)",
    ),
    "stormlog": Contender(
        "stormlog tracker",
        _STORMLOG_IMPORTS,
        "tracker = CPUMemoryTracker(sampling_interval=interval)\ntracker.start_tracking()",
        "tracker.stop_tracking()",
    ),
    "stormlog-sink": Contender(
        "stormlog tracker + sink",
        _STORMLOG_IMPORTS,
        "tracker = CPUMemoryTracker(sampling_interval=interval,\n"
        "                           telemetry_sink_config=TelemetrySinkConfig(root_dir=Path(out_dir)))\n"
        "tracker.start_tracking()",
        "tracker.stop_tracking()",
    ),
}
RSS_ROWS = ["bare", "stepwatch", "stepwatch-full", "stormlog", "stormlog-sink"]
CPU_GROUPS = [  # children of one group run together
    [("bare", 1.0)],
    [("stepwatch", 1.0), ("stepwatch", 0.1)],
    [("stormlog", 1.0), ("stormlog", 0.1)],
    [("stormlog-sink", 1.0), ("stormlog-sink", 0.1)],
]


def _code(name: str) -> str:
    c = CONTENDERS[name]
    return CHILD.format(imports=c.imports, start=c.start, stop=c.stop, settled=c.settled, after=c.after)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_child(name: str, out_dir: Path, interval: float, settle_s: float, window_s: float) -> dict[str, Any]:
    """One fresh interpreter running the contender; returns the JSON it printed."""
    command = [sys.executable, "-c", _code(name), str(out_dir), str(interval), str(settle_s), str(window_s)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child {name} failed with exit status {proc.returncode}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1])
    result["stderr"] = proc.stderr.strip()[-2000:] or None
    result["bytes_written"] = _dir_bytes(out_dir)
    return result


def _best_wall(code: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, capture_output=True)
        best = min(best, time.perf_counter() - started)
    return best


def _importtime_top(code: str, count: int) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, module) of the first-level imports under ``python -X importtime``
    (those the command itself triggered), the ``count`` slowest."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO_ROOT)
    rows = []
    started = False  # interpreter start-up ends with ``site``; what follows is the command's
    for line in proc.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\S.*)$", line)
        if match and started:
            rows.append((int(match.group(2)), int(match.group(1)), match.group(3)))
        elif match and match.group(3) == "site":
            started = True
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rss-repeat", type=int, default=3, help="children per RSS row; median kept (default 3)")
    parser.add_argument("--cpu-seconds", type=float, default=10.0, help="CPU measurement window (default 10)")
    parser.add_argument("--cpu-parallel", type=int, default=2,
                        help="children of one contender run at once in the CPU part (default 2)")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where run and sink directories are written (default: the temp dir)")
    args = parser.parse_args()

    header = machine_header(args.tmp_dir)
    header["versions"].update(versions("psutil", "torch"))
    print_header("capture footprint: RSS, import cost, CPU while idle (no torch in the program)", header)
    work = Path(tempfile.mkdtemp(prefix="bench-capture-footprint-", dir=args.tmp_dir))
    counter = iter(range(1_000_000))
    rss: dict[str, list[dict[str, Any]]] = {}
    cpu: list[dict[str, Any]] = []
    try:
        # -- RSS ------------------------------------------------------------------------------
        for name in RSS_ROWS:
            print(f"RSS: {name} x{args.rss_repeat} ...", flush=True)
            rss[name] = [run_child(name, work / f"{name}-{next(counter)}", 1.0, 2.0, 0.0)
                         for _ in range(args.rss_repeat)]
        # -- import ---------------------------------------------------------------------------
        print("import: wall times, best of 10 ...", flush=True)
        walls = {
            "pass": _best_wall("pass", 10),
            "import stepwatch": _best_wall("import stepwatch", 10),
            "import stepwatch; stepwatch.init": _best_wall("import stepwatch; stepwatch.init", 10),
            "import stormlog tracker": _best_wall("from stormlog.cpu_profiler import CPUMemoryTracker", 5),
        }
        importtime = _importtime_top("import stepwatch; stepwatch.init", 8)
        # -- CPU ------------------------------------------------------------------------------
        for group in CPU_GROUPS:
            labels = ", ".join(f"{n} @{1 / i:.0f} Hz" for n, i in group)
            print(f"CPU: {labels}, {args.cpu_seconds:.0f} s window ...", flush=True)
            with ThreadPoolExecutor(max_workers=max(1, args.cpu_parallel)) as pool:
                futures = [
                    (name, interval, pool.submit(run_child, name, work / f"cpu-{name}-{next(counter)}",
                                                 interval, 2.0, args.cpu_seconds))
                    for name, interval in group
                ]
                for name, interval, future in futures:
                    cpu.append({"contender": name, "interval_s": interval, **future.result()})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rss[name])

    def median_extra(name: str, key: str) -> float:
        return statistics.median(r["extra"][key] for r in rss[name])

    # Every child reads RSS right after start-up, after its imports and 2 s after starting the
    # contender: "added" compares with the bare child at the same moment.
    for r in rss["stepwatch-full"]:
        r["rss_full_bytes"] = r["extra"]["rss_full_bytes"]
    bare_start = median("bare", "rss_start_bytes")
    bare_settled = median("bare", "rss_settled_bytes")
    summary: dict[str, dict[str, float]] = {}
    rows = []

    def rss_row(label: str, name: str, key: str, reference: float) -> None:
        added = median(name, key) - reference
        in_process = statistics.median(r[key] - r["rss_start_bytes"] for r in rss[name])
        summary[label] = {"rss_bytes": median(name, key), "added_bytes": added,
                          "added_in_process_bytes": in_process}
        first = rss[name][0]
        imported = key == "rss_imported_bytes"
        rows.append([
            label,
            f"{median(name, key) / 2**20:.1f}",
            f"{added / MB:.1f}" if name != "bare" else "",
            f"{in_process / MB:.1f}" if name != "bare" else "",
            f"{median(name, 'rss_peak_bytes') / 2**20:.1f}" if not imported else "",
            str(first["modules_after_import"] if imported else first["modules_loaded"]),
            str(first["threads"]) if not imported else "1",
        ])

    rss_row("bare interpreter", "bare", "rss_settled_bytes", bare_settled)
    rss_row("import stepwatch", "stepwatch", "rss_imported_bytes", bare_start)
    rss_row("stepwatch init + 2 s", "stepwatch", "rss_settled_bytes", bare_settled)
    rss_row("stepwatch init, tables full", "stepwatch-full", "rss_full_bytes", bare_settled)
    rss_row("stepwatch init, tables full: peak", "stepwatch-full", "rss_peak_bytes", bare_settled)
    rss_row("stepwatch init, tables full + 2 s", "stepwatch-full", "rss_settled_bytes", bare_settled)
    rss_row("import stormlog tracker", "stormlog", "rss_imported_bytes", bare_start)
    rss_row("stormlog tracker + 2 s", "stormlog", "rss_settled_bytes", bare_settled)
    rss_row("stormlog tracker + sink + 2 s", "stormlog-sink", "rss_settled_bytes", bare_settled)
    print(f"Resident memory, median of {args.rss_repeat} fresh children (MB = 10^6 bytes)")
    print_table(["contender", "RSS MiB", "added MB", "added MB (in-proc)", "peak MiB", "modules", "threads"], rows)
    sw_added = summary["stepwatch init + 2 s"]["added_bytes"]
    sl_added = summary["stormlog tracker + 2 s"]["added_bytes"]
    sls_added = summary["stormlog tracker + sink + 2 s"]["added_bytes"]
    print()
    print(f"RSS added by stepwatch init + 2 s: {sw_added / MB:.1f} MB "
          f"(target <= {TARGET_RSS_MB:.0f} MB: {'met' if sw_added / MB <= TARGET_RSS_MB else 'NOT met'}); "
          f"stormlog tracker adds {sl_added / MB:.1f} MB ({sl_added / sw_added:.1f}x), "
          f"with sink {sls_added / MB:.1f} MB ({sls_added / sw_added:.1f}x)")
    full_added = summary["stepwatch init, tables full"]["added_bytes"]
    peak_added = summary["stepwatch init, tables full: peak"]["added_bytes"]
    queued = median_extra("stepwatch-full", "rows_queued_at_fill")
    print(f"with its tables full ({median_extra('stepwatch-full', 'table_rows'):,.0f} rows per table): "
          f"{full_added / MB:.1f} MB at the end of the fill, {peak_added / MB:.1f} MB at the high-water mark "
          f"(target {'met' if peak_added / MB <= TARGET_RSS_MB else 'NOT met'} at the peak); "
          f"{queued:,.0f} rows queued at the fill's end, "
          f"{(full_added - sw_added) / max(queued, 1):.0f} B per queued row over plain init; "
          f"{median_extra('stepwatch-full', 'rows_queued'):,.0f} still queued 2 s later")
    sw = rss["stepwatch"][0]
    print(f"torch imported: stepwatch {'yes' if sw['torch_loaded'] else 'no'}, "
          f"stormlog {'yes' if rss['stormlog'][0]['torch_loaded'] else 'no'}; "
          f"numpy imported: stepwatch {'yes' if sw['numpy_loaded'] else 'no'}, "
          f"stormlog {'yes' if rss['stormlog'][0]['numpy_loaded'] else 'no'}")
    print(f"top-level modules that `stepwatch.init(...)` loads: {', '.join(sw['top_level_packages'])}")
    print()

    base = walls["pass"]
    print("Import cost: wall time of a fresh `python -c` (best of 10, stormlog best of 5); in-process medians")
    print_table(
        ["command", "wall ms", "minus `pass` ms", "in-process ms"],
        [
            ["python -c pass", f"{base * 1000:.0f}", "", ""],
            ["import stepwatch", f"{walls['import stepwatch'] * 1000:.0f}",
             f"{(walls['import stepwatch'] - base) * 1000:.0f}", f"{median('stepwatch', 'import_s') * 1000:.1f}"],
            ["import stepwatch; stepwatch.init (loads modules)",
             f"{walls['import stepwatch; stepwatch.init'] * 1000:.0f}",
             f"{(walls['import stepwatch; stepwatch.init'] - base) * 1000:.0f}",
             f"{median_extra('stepwatch', 'load_modules_s') * 1000:.0f}"],
            ["stepwatch.init(out=..., interval=1.0) call", "", "",
             f"{median_extra('stepwatch', 'init_call_s') * 1000:.0f}"],
            ["from stormlog.cpu_profiler import CPUMemoryTracker", f"{walls['import stormlog tracker'] * 1000:.0f}",
             f"{(walls['import stormlog tracker'] - base) * 1000:.0f}", f"{median('stormlog', 'import_s') * 1000:.0f}"],
            ["stormlog CPUMemoryTracker(...).start_tracking()", "", "", f"{median('stormlog', 'start_s') * 1000:.0f}"],
        ],
    )
    print(f"`import stepwatch` loads {sw['modules_after_import']} modules; the runtime brings the total to "
          f"{sw['modules_loaded']} (stormlog's tracker import: {rss['stormlog'][0]['modules_after_import']})")
    print("slowest first-level imports of `import stepwatch; stepwatch.init` (python -X importtime, one run):")
    for cumulative_us, self_us, module in importtime:
        print(f"  {cumulative_us / 1000:6.1f} ms cumulative  {self_us / 1000:5.1f} ms self  {module}")
    print()

    reference = {r["interval_s"]: r["cpu_s"] / r["window_s"] for r in cpu if r["contender"] == "stormlog"}
    reference_sink = {r["interval_s"]: r["cpu_s"] / r["window_s"] for r in cpu if r["contender"] == "stormlog-sink"}
    rows = []
    for r in cpu:
        share = r["cpu_s"] / r["window_s"]
        bare = r["contender"] == "bare"
        rows.append([
            CONTENDERS[r["contender"]].label,
            f"{1 / r['interval_s']:.0f} Hz" if not bare else "",
            f"{r['cpu_s'] * 1000:.1f}",
            f"{share * 100:.3f}",
            f"{r['voluntary_switches'] / r['window_s']:.1f}",
            f"{r['rss_end_bytes'] / 2**20:.1f}",
            f"{r['bytes_written'] / 1024:.0f}",
            f"{r['stop_s'] * 1000:.0f}" if not bare else "",
            f"{share / reference[r['interval_s']]:.2f}x" if not bare else "",
            f"{share / reference_sink[r['interval_s']]:.2f}x" if not bare else "",
        ])
    print(f"CPU while the program sleeps {args.cpu_seconds:.0f} s (after 2 s settling): process CPU time of all "
          "threads; ratios against stormlog at the same rate")
    print_table(["contender", "rate", "CPU ms", "% of a core", "wakeups/s", "RSS MiB", "KiB written",
                 "stop ms", "vs stormlog", "vs stormlog+sink"], rows)

    header["load_average_at_end"] = load_average()
    path = write_results("capture_footprint", {
        "header": header,
        "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
        "rss": rss,
        "rss_summary": summary,
        "import_wall_s": walls,
        "importtime_top": importtime,
        "cpu": cpu,
        "target_rss_mb": TARGET_RSS_MB,
    })
    print(f"\nraw results: {path}")


if __name__ == "__main__":
    os.environ.pop("STEPWATCH_INTERVAL_MS", None)  # the children's interval comes from argv only
    main()
