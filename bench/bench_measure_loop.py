"""The acceptance measure's loop (bench/README.md, "The per-step measure the target is judged
by"), counted the fast way: per-step instructions of the training thread under callgrind, plain
torch against an out-of-the-box ``stepwatch.init()``, at two depths.

Usage::

    .venv/bin/python bench/bench_measure_loop.py [--depths 1 16] [--steps 500] [--jobs 4] [--arms thread]

The acceptance measure runs each arm twice under full instrumentation (N1 and N2 steps) and
subtracts: importing torch under callgrind is most of its ~20 CPU-minutes, and on a loaded
machine a run can pass its own time limit. Here the same program (a width-64 MLP of DEPTH hidden
layers fed by a DataLoader of batch 16, SGD, cross-entropy, ``stepwatch.init()`` with its
defaults, 20 warm-up steps) starts uninstrumented (``--instr-atstart=no``), turns
instrumentation on after the warm-up and asks for one dump after ``--steps`` steps
(``bench_step_instructions._ClientRequests``): that dump is exactly what the training thread
executed over those steps, one process per arm and depth. The per-step figures track the
acceptance measure's to a few k (its window is steps 30-530 of two processes; both count the
time-driven work that lands on the training thread).

Besides the total, each row gives the part outside glibc's ``malloc``/``free``: torch's tensor
allocations go through glibc, whose cost a step moves by +-3k between runs of the same code with
the heap's layout (what else the process allocated, and when), so code changes are best
compared on that column. The interpreter loop's own instructions (``_PyEval_EvalFrameDefault``,
the bytecodes the Python code executed) are printed too: they move only when the Python a step
runs changes, whereas glibc's heap and CPython's type-attribute cache (slots hashed from the
addresses of attribute names and types' version tags) move the rest by a few k a step between
builds whose per-step code is the same. ``--arms thread`` adds plain torch with one idle thread:
once a process has a second thread, glibc's allocator takes its arena's lock on every tensor's
allocation and free, a cost any in-process recorder with a thread adds, before its own code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCRIPT = Path(__file__).resolve()
# "thread": plain torch with one idle thread beside it, what any in-process recorder's thread
# (stepwatch's sampler, TraceML's) costs the training thread before it does anything
ARMS = ("plain", "thread", "stepwatch")
WARMUP = 20
_TRIGGER = "desc: Trigger: Client Request: "
_COST = re.compile(r"\s*([\d,]+)\s+\(.*?\)\s+(.*)")


def _worker(arm: str, depth: int, steps: int) -> None:
    """Runs under callgrind: the measure's loop, instrumented from the end of its warm-up."""
    import torch
    from bench_step_instructions import _ClientRequests
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(16384, 64), torch.randint(0, 10, (16384,)))
    loader = DataLoader(data, batch_size=16, shuffle=False)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    if arm == "thread":
        import threading

        threading.Thread(target=threading.Event().wait, daemon=True).start()
    if arm == "stepwatch":
        import stepwatch

        stepwatch.init(out=tempfile.mkdtemp(prefix="bench-measure-loop-"))

    def train(count: int) -> None:
        batches = iter(loader)
        for _ in range(count):
            x, y = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()

    requests = _ClientRequests()
    if not requests.running_on_valgrind():
        raise SystemExit("the worker must run under valgrind --tool=callgrind (the parent starts it so)")
    train(WARMUP)
    requests.start_instrumentation()
    train(steps)
    requests.dump(f"{arm} depth={depth} steps={steps}")
    sys.stdout.flush()
    os._exit(0)  # no exit handler counted, as in the acceptance measure


def _main_thread_dump(directory: Path) -> Path:
    for path in sorted(directory.glob("callgrind.out.*-01")):
        with path.open() as handle:
            if any(line.startswith(_TRIGGER) for line in handle):
                return path
    raise SystemExit(f"{directory}: no client-request dump of the main thread (see valgrind.log there)")


def _costs(path: Path) -> tuple[int, int, int]:
    """(all instructions, those in glibc's malloc family, those of the interpreter loop) of one dump."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
                          capture_output=True, text=True, check=True).stdout
    total = malloc = interpreter = 0
    for line in text.splitlines():
        match = _COST.match(line)
        if match is None:
            continue
        value, name = int(match.group(1).replace(",", "")), match.group(2)
        if "PROGRAM TOTALS" in name:
            total = value
        elif "malloc/" in name or "/arena.c" in name:
            malloc += value
        elif ":_PyEval_EvalFrameDefault" in name:
            interpreter += value
    return total, malloc, interpreter


def _run(arm: str, depth: int, steps: int, work: Path) -> tuple[int, int, int]:
    out = work / f"{arm}-{depth}"
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", "--instr-atstart=no",
                    f"--callgrind-out-file={out}/callgrind.out.%p", f"--log-file={out}/valgrind.log",
                    sys.executable, str(SCRIPT), "--worker", arm, str(depth), str(steps)],
                   cwd=out, env=env, check=True, stdout=subprocess.DEVNULL)
    return _costs(_main_thread_dump(out))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=4, help="callgrind runs at once")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["plain", "stepwatch"],
                        help="plain and stepwatch always; add thread for an idle thread's share")
    parser.add_argument("--tmp-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.tmp_dir is not None:
        args.tmp_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-measure-loop-", dir=args.tmp_dir))
    arms = [arm for arm in ARMS if arm in {"plain", "stepwatch", *args.arms}]
    runs = [(arm, depth) for depth in args.depths for arm in arms]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        got = dict(zip(runs, pool.map(lambda run: _run(*run, args.steps, work), runs)))
    added: dict[int, float] = {}
    outside: dict[int, float] = {}
    loop: dict[int, float] = {}
    alone: dict[int, float] = {}
    for depth in args.depths:
        (plain, plain_malloc, plain_loop), (sw, sw_malloc, sw_loop) = got[("plain", depth)], got[("stepwatch", depth)]
        n = args.steps
        added[depth] = (sw - plain) / n
        outside[depth] = ((sw - sw_malloc) - (plain - plain_malloc)) / n
        loop[depth] = (sw_loop - plain_loop) / n
        print(f"depth {depth} ({2 * depth + 2} module calls): plain {plain / n / 1e3:,.1f}k instr/step; "
              f"stepwatch +{added[depth] / 1e3:.1f}k (+{outside[depth] / 1e3:.1f}k outside glibc malloc; "
              f"malloc {(sw_malloc - plain_malloc) / n / 1e3:+.1f}k; interpreter loop {loop[depth] / 1e3:+.1f}k)",
              flush=True)
        if ("thread", depth) in got:
            thread, thread_malloc, _ = got[("thread", depth)]
            alone[depth] = (thread - plain) / n
            print(f"  an idle thread alone: +{alone[depth] / 1e3:.1f}k instr/step "
                  f"(glibc malloc {(thread_malloc - plain_malloc) / n / 1e3:+.1f}k); "
                  f"stepwatch over it +{(sw - thread) / n / 1e3:.1f}k", flush=True)
    if len(added) > 1:
        lo, hi = min(added), max(added)
        calls = 2 * (hi - lo)
        print(f"per extra module call: {(added[hi] - added[lo]) / calls / 1e3:.2f}k "
              f"(outside glibc malloc {(outside[hi] - outside[lo]) / calls / 1e3:.2f}k; "
              f"interpreter loop {(loop[hi] - loop[lo]) / calls / 1e3:.2f}k)")
        if len(alone) > 1:
            print(f"  an idle thread alone: {(alone[hi] - alone[lo]) / calls / 1e3:.2f}k per extra module call; "
                  f"stepwatch over it {((added[hi] - alone[hi]) - (added[lo] - alone[lo])) / calls / 1e3:.2f}k")
    print(f"dumps in {work}")


if __name__ == "__main__":
    main()
