"""Per-step cost of training instrumentation counted in instructions: the training thread's
instructions per step under callgrind, plain torch vs stepwatch vs TraceML 0.5.0, on tiny MLPs
of two depths, so that a cost that grows with the model's module count shows as a slope.

Usage::

    .venv/bin/python bench/bench_step_instructions.py [--depths 2 16] [--n1 50] [--n2 150]
        [--only NAME ...] [--annotate] [--tmp-dir DIR]

Why instructions: wall-clock medians on a shared 2-core machine swing by more than the few
microseconds a step is about, while callgrind's instruction count of one thread is the same
from run to run (to a few hundred instructions a step). It weighs a branch, a dict lookup and a
Python frame by their instructions, not their time, so it is the measure of the Python work a
step does, not of what it costs in cache misses.

One process per contender, under ``valgrind --tool=callgrind --separate-threads=yes
--instr-atstart=no`` (``--worker NAME``): the interpreter, torch and the tool start
uninstrumented (about 4x faster than instrumented; importing torch is most of a run), then the
worker turns instrumentation on itself (callgrind's client requests, issued through a few bytes
of machine code: ``_ClientRequests``) and, per depth, runs ``--n1`` steps, asks callgrind for a
dump, runs up to ``--n2`` steps and asks for another. A client request's dump holds the calling
thread alone (``--separate-threads=yes``): the second one is exactly what the training thread
executed from step N1 to step N2, so start-up and warm-up cancel: ``(I(N2) - I(N1)) / (N2 -
N1)``. The tool's background threads are not counted (they are dumped only at exit).

Contenders (the loop and setup of ``bench_training_overhead.py``, its ``Workload`` with tiny
widths: ``(features 8, hidden 8, depth hidden layers, batch 8)``, each hidden layer a Linear and
a ReLU, so ``2 * depth + 2`` module calls a forward plus the loss module):

  * ``plain``: torch alone;
  * ``stepwatch``: ``stepwatch.init(out=DIR, interval=1.0)``, each step in ``trace_step(model)``;
  * ``stepwatch-inferred``: the same without ``trace_step`` (steps inferred by the patches: the
    loop with no code change);
  * ``traceml``: ``traceml_ai.init(mode="auto", ...)`` shipping to a real ``traceml serve``
    (started natively by the parent, as in ``bench_training_overhead.py``), each step in
    ``traceml.trace_step(model)``.

``--annotate`` adds, per depth, the C functions whose own instructions per step differ most
between stepwatch and plain (``callgrind_annotate`` of the two training-thread dumps). Python
code shows there as the interpreter's functions (``_PyEval_EvalFrameDefault`` and the calls it
makes), so this says what kind of work was added (frames, attribute and dict lookups, calls
through C), not which Python line.

Target (issue 15, section 4): stepwatch adds at most 30k instructions per step at any depth.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

SCRIPT = Path(__file__).resolve()
CONTENDERS = ("plain", "stepwatch", "stepwatch-inferred", "traceml")
TARGET_ADDED = 30_000  # instructions per step, at any depth
TINY = (8, 8, 8)  # input features, hidden width, batch size


# -- callgrind's client requests, from Python ------------------------------------------------------


class _ClientRequests:
    """Callgrind's client requests (valgrind.h's ``VALGRIND_DO_CLIENT_REQUEST`` on amd64) as a
    callable: eight instructions in an executable page, called through ctypes, so no compiler
    or header is needed. Outside valgrind the magic sequence is a no-op that returns 0.

    ``req(args)``: rax = args (the request code and five arguments), rdx = 0 (the default
    result); the four ``rol`` of rdi (3 + 13 + 61 + 51 = 128 bits: rdi unchanged) followed by
    ``xchg rbx, rbx`` is the pattern valgrind recognises; the result comes back in rdx."""

    _CODE = bytes.fromhex(
        "4889f8"  # mov rax, rdi
        "31d2"  # xor edx, edx
        "48c1c703" "48c1c70d" "48c1c73d" "48c1c733"  # rol rdi, 3 / 13 / 61 / 51
        "4887db"  # xchg rbx, rbx
        "4889d0"  # mov rax, rdx
        "c3"  # ret
    )
    _RUNNING_ON_VALGRIND = 0x1001
    _CALLGRIND = (ord("C") << 24) | (ord("T") << 16)
    _DUMP_STATS_AT = _CALLGRIND + 3
    _START_INSTRUMENTATION = _CALLGRIND + 4

    def __init__(self) -> None:
        import platform

        if platform.machine() not in ("x86_64", "AMD64"):
            raise SystemExit(f"callgrind client requests are written for x86-64, not {platform.machine()}")
        self._page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        self._page.write(self._CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self._call = ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_void_p)(address)

    def _request(self, code: int, arg: int = 0) -> int:
        args = (ctypes.c_ulong * 6)(code, arg, 0, 0, 0, 0)
        return self._call(ctypes.addressof(args))

    def running_on_valgrind(self) -> bool:
        return self._request(self._RUNNING_ON_VALGRIND) > 0

    def start_instrumentation(self) -> None:
        self._request(self._START_INSTRUMENTATION)

    def dump(self, label: str) -> None:
        """Writes every thread's counts since the last dump, as part files named by ``label``."""
        text = ctypes.create_string_buffer(label.encode())
        self._request(self._DUMP_STATS_AT, ctypes.addressof(text))


# -- the worker (runs under callgrind) -------------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True, choices=CONTENDERS)
    parser.add_argument("--depths", type=int, nargs="+", required=True)
    parser.add_argument("--n1", type=int, required=True)
    parser.add_argument("--n2", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)

    import bench_training_overhead as overhead

    requests = _ClientRequests()
    if not requests.running_on_valgrind():
        raise SystemExit("the worker must run under valgrind --tool=callgrind (the parent starts it so)")
    overhead._torch_setup()  # one torch thread; before init: the patches install when torch is imported
    trace_step, stop = _contender(args)
    for depth in args.depths:
        overhead.CONFIGS[f"depth{depth}"] = (TINY[0], TINY[1], depth, TINY[2])
    loads = [overhead.Workload(f"depth{depth}", args.n1, trace_step) for depth in args.depths]
    for work in loads:
        work.traced()  # first pass uninstrumented: torch's and the tool's lazy set-up
    requests.start_instrumentation()
    for depth, work in zip(args.depths, loads):
        work.traced()  # steps 0..N1 (a pass over the loader is N1 batches)
        requests.dump(f"depth={depth} steps=0..{args.n1}")
        for _ in range((args.n2 - args.n1) // args.n1):
            work.traced()
        requests.dump(f"depth={depth} steps={args.n1}..{args.n2}")
    stop()
    print(json.dumps({"worker": args.worker, "pid": os.getpid()}))


def _contender(args: argparse.Namespace) -> tuple[Callable[[Any], Any] | None, Callable[[], None]]:
    """The contender's ``trace_step`` (None: the plain loop) and its shutdown."""
    if args.worker == "plain":
        return None, lambda: None
    if args.worker.startswith("stepwatch"):
        import stepwatch

        runtime = stepwatch.init(out=args.out, interval=1.0)
        if runtime.patches is None or not runtime.patches.installed:
            raise SystemExit("stepwatch did not install its torch patches at init")
        return (stepwatch.trace_step if args.worker == "stepwatch" else None), stepwatch.shutdown
    import traceml_ai as traceml

    config = traceml.init(mode="auto", logs_dir=str(args.out), session_id="bench", ui_mode="summary",
                          interval=1.0, aggregator_port=args.port, on_missing_aggregator="raise")
    if config.disabled or config.mode != "auto":
        raise SystemExit(f"TraceML did not start in auto mode: {config}")

    def stop() -> None:
        from traceml_ai.sdk import initial

        initial._stop_runtime_for_init()

    return traceml.trace_step, stop


# -- the parent ------------------------------------------------------------------------------------


_PART = re.compile(r"\.(\d+)\.(\d+)-(\d+)$")  # callgrind.out.PID.DUMP-THREAD
_TRIGGER = "desc: Trigger: Client Request: "


def read_parts(directory: Path, pid: int) -> dict[str, dict[int, Path]]:
    """The dump parts of one run: label -> thread id -> file."""
    parts: dict[str, dict[int, Path]] = {}
    for path in directory.glob(f"callgrind.out.{pid}.*"):
        match = _PART.search(path.name)
        if match is None:
            continue
        label = None
        with path.open() as handle:
            for line in handle:
                if line.startswith(_TRIGGER):
                    label = line[len(_TRIGGER):].strip()
                    break
        if label is not None:
            parts.setdefault(label, {})[int(match.group(3))] = path
    return parts


def total_instructions(path: Path) -> int:
    with path.open() as handle:
        for line in handle:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise SystemExit(f"{path}: no totals line (an incomplete callgrind dump)")


def run_contender(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / name
    out.mkdir(parents=True)
    extra: list[str] = []
    aggregator = None
    if name == "traceml":
        from bench_training_overhead import start_aggregator

        aggregator, port, _log = start_aggregator(work / "traceml-logs")
        extra = ["--port", str(port)]
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
               f"--callgrind-out-file={out}/callgrind.out.%p", f"--log-file={out}/valgrind.log",
               sys.executable, str(SCRIPT), "--worker", name, "--depths", *map(str, args.depths),
               "--n1", str(args.n1), "--n2", str(args.n2), "--out", str(out / "run"), *extra]
    env = dict(os.environ, PYTHONHASHSEED="0")  # same dict layouts in every run
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=3600,
                              check=False)
    finally:
        if aggregator is not None:
            from bench_training_overhead import stop_aggregator

            stop_aggregator(aggregator)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        log = out / "valgrind.log"
        if log.exists():
            sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"worker {name} failed with exit status {proc.returncode}: {' '.join(command)}")
    result = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])
    parts = read_parts(out, result["pid"])
    steps = args.n2 - args.n1
    per_depth: dict[int, dict[str, Any]] = {}
    for depth in args.depths:
        label = f"depth={depth} steps={args.n1}..{args.n2}"
        threads = parts.get(label)
        if not threads or 1 not in threads:
            raise SystemExit(f"worker {name}: no dump '{label}' of the training thread in {out}")
        per_depth[depth] = {
            "training_per_step": total_instructions(threads[1]) / steps,
            "training_file": str(threads[1]),
        }
    return {"per_depth": per_depth, "wall_s": time.perf_counter() - started}


def callgrind_costs(path: Path, *, inclusive: bool = False) -> dict[str, int]:
    """Instructions per C function (``file:function``, no directories) of one dump, from
    ``callgrind_annotate``: own (exclusive) by default, inclusive with ``inclusive``."""
    proc = subprocess.run(["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", "--threshold=100",
                           str(path)], capture_output=True, text=True, check=True)
    costs: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", line)
        if match is None or ":" not in match.group(2):
            continue
        where = match.group(2).split(" [", 1)[0].rsplit("/", 1)[-1]
        count = int(match.group(1).replace(",", ""))
        # a function listed twice: its inclusive cost is the larger, its own cost the sum
        costs[where] = max(costs.get(where, 0), count) if inclusive else costs.get(where, 0) + count
    return costs


def print_annotation(results: dict[str, Any], args: argparse.Namespace, rows: int = 15) -> None:
    steps = args.n2 - args.n1
    for name in ("stepwatch", "stepwatch-inferred", "traceml"):
        if name not in results or "plain" not in results:
            continue
        for depth in args.depths:
            base = callgrind_costs(Path(results["plain"]["per_depth"][depth]["training_file"]))
            ours = callgrind_costs(Path(results[name]["per_depth"][depth]["training_file"]))
            diff = {k: (ours.get(k, 0) - base.get(k, 0)) / steps for k in set(base) | set(ours)}
            top = sorted(diff.items(), key=lambda kv: abs(kv[1]), reverse=True)[:rows]
            print(f"\n{name} - plain, depth {depth}: own instructions per step, largest differences "
                  f"(total {sum(diff.values()):+,.0f})")
            print_table(["function (file:name)", "added per step"], [[k, f"{v:+,.0f}"] for k, v in top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 16], help="hidden layers (default: 2 16)")
    parser.add_argument("--n1", type=int, default=50, help="steps before the first dump; a pass (default 50)")
    parser.add_argument("--n2", type=int, default=150, help="steps at the second dump, a multiple of --n1 (default 150)")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                        help="contenders to run (default: all; plain is needed for the added columns)")
    parser.add_argument("--annotate", action="store_true",
                        help="also print the C functions whose own instructions per step stepwatch changes most")
    parser.add_argument("--tmp-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where callgrind's files and the run directories go (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep callgrind's files (the path is printed)")
    args = parser.parse_args()
    if args.n1 <= 0 or args.n2 <= args.n1 or args.n2 % args.n1:
        parser.error("--n2 must be a multiple of --n1, and larger")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")

    header = machine_header(args.tmp_dir)
    header["versions"] = versions("stepwatch", "torch", "traceml-ai")
    header["valgrind"] = subprocess.run(["valgrind", "--version"], capture_output=True, text=True,
                                        check=False).stdout.strip()
    print_header("training instrumentation overhead in instructions: the training thread under callgrind", header)
    f, h, b = TINY
    print(f"loop: MLP {f}->{h}x{{{','.join(map(str, args.depths))}}}->10 (ReLU) on CPU, batch {b}, SGD momentum, "
          f"cross-entropy, DataLoader(num_workers=0) of {args.n1} batches a pass, torch threads 1")
    print(f"counted: steps {args.n1}..{args.n2} of each depth, {header['valgrind']} --separate-threads=yes\n")
    work = Path(tempfile.mkdtemp(prefix="bench-step-instructions-", dir=args.tmp_dir))
    results: dict[str, Any] = {}
    try:
        for name in args.only:
            print(f"running {name} under callgrind ... (load average {load_average()})", flush=True)
            results[name] = run_contender(name, args, work)
        if args.annotate:
            print_annotation(results, args)
    finally:
        if args.keep:
            print(f"\ncallgrind files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()

    rows = []
    verdicts: dict[str, Any] = {}
    for depth in args.depths:
        plain = results.get("plain", {}).get("per_depth", {}).get(depth)
        traceml = results.get("traceml", {}).get("per_depth", {}).get(depth)
        traceml_added = traceml["training_per_step"] - plain["training_per_step"] if plain and traceml else None
        for name, result in results.items():
            entry = result["per_depth"][depth]
            added = entry["training_per_step"] - plain["training_per_step"] if plain else None
            entry["added_per_step"] = added
            ratio = (added / traceml_added if added is not None and traceml_added and name not in ("plain", "traceml")
                     else None)
            rows.append([f"{depth}", name, f"{entry['training_per_step']:,.0f}",
                         "" if added is None or name == "plain" else f"{added:+,.0f}",
                         "" if ratio is None else f"{ratio:.3f}"])
            if name.startswith("stepwatch") and added is not None:
                verdicts.setdefault(name, {})[depth] = {"added": added, "pass": added <= TARGET_ADDED, "ratio": ratio}
    print_table(["depth", "contender", "training thread instr/step", "added vs plain", "ratio to TraceML"], rows)
    print(f"\ninstr/step: (I(N2) - I(N1)) / (N2 - N1) of the training thread (callgrind thread 1), "
          f"N1 = {args.n1}, N2 = {args.n2}. Plain torch itself moves by up to ~5k a step from run to run.")
    for name, per_depth in verdicts.items():
        text = ", ".join(f"depth {d}: {v['added']:+,.0f} ({'PASS' if v['pass'] else 'FAIL'})" for d, v in per_depth.items())
        print(f"{name}: added instructions per step <= {TARGET_ADDED:,}: {text}")
    header["load_average_at_end"] = load_average()
    path = write_results("step_instructions", {"header": header, "args": vars(args) | {"tmp_dir": str(args.tmp_dir)},
                                               "results": results, "verdicts": verdicts,
                                               "target_added": TARGET_ADDED})
    print(f"raw results: {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[1:])
    else:
        main()
