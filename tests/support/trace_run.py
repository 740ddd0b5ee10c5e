"""One real two-rank ``stepwatch run`` (torchrun, gloo) of tests/exports/programs/trace_train.py,
made once per test session and shared by the tests of the exports, of ``stepwatch query`` and of
the launcher's end-to-end run (read only: a test that must change it copies it first)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from . import ROOT, STEPWATCH, clean_env, free_port
from .shared import once

PROGRAM = ROOT / "exports" / "programs" / "trace_train.py"  # ROOT: the tests directory
STEPS_PER_RANK = 24  # two epochs of 12


def _train(base: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = base / "run"
    command = [*STEPWATCH, "run", "--nproc-per-node", "2", "--master-port", str(free_port()), "--interval", "100",
               "--out", str(out), str(PROGRAM)]
    proc = subprocess.run(command, cwd=base, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / "run.json").read_text())["outcome"] == "succeeded"
    return out, proc


def trace_run_with_output(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The run directory and what ``stepwatch run`` printed (the summary on stdout)."""
    return once(tmp_path_factory, "exports-two-ranks", _train)


def trace_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory (history.sqlite, run.json, the ranks' artifacts)."""
    return trace_run_with_output(tmp_path_factory)[0]
