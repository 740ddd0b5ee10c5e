"""A step cut short by the end of the process is recorded as what it was (issue 20, section 3):
a real loop killed with SIGTERM while it waits in backward (as rank 0 waits in backward's
all-reduce for a rank that hangs) records its step in progress as a training ``step``, flagged
``unclosed`` with the phase it was cut in; never as an ``eval_step``, and the summary's
evaluation time stays 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch.analysis.epochs import epoch_report
from stepwatch.artifacts.spool import read_spool
from tests.support import clean_env
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

PROGRAM = Path(__file__).resolve().parent / "programs" / "killed_in_backward.py"




@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return once(tmp_path_factory, "capture-killed-in-backward", _killed_run)


def _killed_run(base: Path) -> tuple[Path, int]:
    run_dir, flag = base / "run", base / "in_backward"
    process = subprocess.Popen([sys.executable, str(PROGRAM), str(run_dir), str(flag)], env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not flag.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), process.communicate(timeout=10)[0]
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, output
    return run_dir, process.returncode


def test_the_step_killed_in_backward_is_a_training_step_cut_in_backward(killed_run: tuple[Path, int]) -> None:
    spans = read_spool(killed_run[0]).spans
    steps = sorted((s for s in spans if s["name"] == "step"), key=lambda s: s["start_ns"])
    assert [s["name"] for s in spans if s["name"] == "eval_step"] == []
    assert len(steps) == 6
    assert all("unclosed" not in (s["attrs"] or {}) for s in steps[:5])
    cut: dict[str, Any] = steps[5]["attrs"]
    assert cut["unclosed"] is True and cut["phase"] == "backward"
    backward = [s for s in spans if s["name"] == "backward" and s["parent_id"] == steps[5]["id"]]
    assert len(backward) == 1 and backward[0]["attrs"]["unclosed"] is True


def test_the_summary_counts_no_evaluation(killed_run: tuple[Path, int]) -> None:
    report = epoch_report(read_spool(killed_run[0]).spans)
    assert report is not None
    assert report["eval_ms"]["total"] == 0
    assert report["count"] == 1
