"""Instructions the step ledger adds to each step, counted by callgrind.

``Runtime._on_step`` (the hook ``TrainingState.close_step`` calls) with a closed step span, the
ledger on and off, at N1 and N2 steps; the main thread's instruction count at N2 minus at N1,
divided by N2 - N1, so start-up cancels. Run::

    python bench/bench_step_ledger_instructions.py            # drives valgrind, prints the figures
    python bench/bench_step_ledger_instructions.py N on|off   # one measured process (valgrind runs this)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

N1, N2 = 2_000, 12_000


def measured(steps: int, ledger: bool) -> None:
    import stepwatch
    from stepwatch.capture import runtime as rt
    from stepwatch.capture.spans import OpenSpan

    if not ledger:
        rt.Runtime._open_ledger = lambda self: None  # type: ignore[method-assign]
    runtime = stepwatch.init(out=tempfile.mkdtemp(), interval=3600, heartbeat_interval=3600, auto_instrument=False)
    span = OpenSpan(id=1, name="step", parent_id=None, index=0, start_ns=1_795_638_917_699_758_221, attrs=None,
                    thread_id=1, phase_ns={"data_load": 1_000, "h2d": 0, "forward": 500_000, "backward": 700_000,
                                           "optimizer_step": 300_000},
                    closed=True, end_ns=1_795_638_917_799_758_221)
    on_step = runtime._on_step  # the hook itself is what is measured
    for i in range(steps):
        span.index = i
        on_step(i + 1, span)
    stepwatch.shutdown()


def main_thread_instructions(steps: int, ledger: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                        sys.executable, __file__, str(steps), "on" if ledger else "off"],
                       check=True, capture_output=True, env=os.environ)
        text = Path(f"{out}-01").read_text()
    found = re.search(r"^totals: (\d+)", text, re.MULTILINE)
    assert found, "no totals line in the callgrind output"
    return int(found.group(1))


def main() -> None:
    per_step = {}
    for ledger in (False, True):
        low, high = main_thread_instructions(N1, ledger), main_thread_instructions(N2, ledger)
        per_step[ledger] = (high - low) / (N2 - N1)
        print(f"ledger {'on ' if ledger else 'off'}: {per_step[ledger]:,.0f} instructions per step (hook)")
    print(f"added by the ledger: {per_step[True] - per_step[False]:,.0f} instructions per step")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        measured(int(sys.argv[1]), sys.argv[2] == "on")
    else:
        main()
