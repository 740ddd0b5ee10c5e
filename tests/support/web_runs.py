"""The dashboard's real runs, trained once per test session (any worker) and read by the tests of
every surface: a clean 2-rank run, a 2-rank run with a straggler, a one-rank run that crashes
after a non-finite loss and a one-rank run killed by SIGKILL. Read only: copy before changing."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from . import ROOT, STEPWATCH, clean_env, free_port
from .shared import once

PROGRAM = ROOT / "web" / "programs" / "train_web.py"  # ROOT: the tests directory
# name -> (ranks, program arguments): what each run shows on its page
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "clean": (2, ("--steps", "60")),
    "straggler": (2, ("--steps", "80", "--slow-rank", "1", "--slow-ms", "12")),
    "crashed": (1, ("--steps", "60", "--nan-at", "10", "--crash-at", "20")),
    "killed": (1, ("--steps", "60", "--kill-at", "25")),
}


def _train_all(base: Path) -> dict[str, dict[str, Any]]:
    """Every run of RUNS at once (they wait on each other's sleeps, not on the CPU alone)."""
    started = {}
    for name, (ranks, args) in RUNS.items():
        command = [*STEPWATCH, "run", "--interval", "200", "--out", str(base / name)]
        if ranks > 1:
            command += ["--nproc-per-node", str(ranks), "--master-port", str(free_port())]
        started[name] = subprocess.Popen([*command, str(PROGRAM), *args], cwd=base, env=clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = {}
    for name, proc in started.items():
        output, _ = proc.communicate(timeout=240)
        done[name] = {"dir": str(base / name), "code": proc.returncode, "output": output[-4000:]}
    return done


def web_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> run directory of each run of RUNS (one directory holds them all)."""
    pytest.importorskip("torch")
    done = once(tmp_path_factory, "web-runs", _train_all)
    for name in ("clean", "straggler"):
        assert done[name]["code"] == 0, done[name]["output"]
    return {name: Path(run["dir"]) for name, run in done.items()}
