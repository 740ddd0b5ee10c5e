"""The real runs every surface reads, trained once per test session (any worker): a clean 2-rank
run, a 2-rank run with a straggler, a one-rank run that crashes after a non-finite loss and a
one-rank run killed by SIGKILL. The dashboard's and the report's browser tests draw them, and the
verdict tests judge the two 2-rank runs (tests/analysis/verdicts). Read only: copy before changing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from . import ROOT, STEPWATCH, clean_env, free_port
from .shared import once

PROGRAM = ROOT / "support" / "programs" / "small_train.py"  # ROOT: the tests directory
# name -> (ranks, program arguments): what each run shows on its page. The 2-rank runs are the
# verdict tests' too: 20 ms of sleep in each forward keeps a loaded machine's noise (a few ms a
# step) well under the straggler threshold in the clean run; the straggler's rank 1 sleeps 5 ms
# more than rank 0 in each 1 ms forward.
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "clean": (2, ("--steps", "100", "--forward-ms", "20")),
    "straggler": (2, ("--steps", "300", "--forward-ms", "1", "--slow-rank", "1", "--slow-forward-ms", "5")),
    "crashed": (1, ("--steps", "60", "--nan-at", "10", "--crash-at", "20")),
    "killed": (1, ("--steps", "60", "--kill-at", "25")),
}


def _train_all(base: Path) -> dict[str, dict[str, Any]]:
    """The clean run alone (its ranks must stay even), then the others at once (they wait on each
    other's sleeps, not on the CPU alone)."""
    done = _train(base, ["clean"])
    done.update(_train(base, [name for name in RUNS if name != "clean"]))
    return done


def _train(base: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    started = {}
    for name in names:
        ranks, args = RUNS[name]
        command = [*STEPWATCH, "run", "--interval", "200", "--out", str(base / name)]
        if ranks > 1:
            command += ["--nproc-per-node", str(ranks), "--master-port", str(free_port())]
        # the live verdicts judge the 2-rank runs twice a second (a change must hold twice)
        started[name] = subprocess.Popen([*command, str(PROGRAM), *args], cwd=base,
                                         env=clean_env(STEPWATCH_VERDICT_INTERVAL_S="0.5"),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}
    for name, proc in started.items():
        stdout, stderr = proc.communicate(timeout=240)
        done[name] = {"dir": str(base / name), "code": proc.returncode, "stdout": stdout, "stderr": stderr}
    return done


def web_run_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> {"dir", "code", "stdout", "stderr"} of each run of RUNS (what ``stepwatch run`` printed)."""
    pytest.importorskip("torch")
    done = once(tmp_path_factory, "web-runs", _train_all)
    for name in ("clean", "straggler"):
        assert done[name]["code"] == 0, done[name]["stdout"][-2000:] + done[name]["stderr"][-2000:]
    return done


def web_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> run directory of each run of RUNS (one directory holds them all)."""
    return {name: Path(run["dir"]) for name, run in web_run_outputs(tmp_path_factory).items()}


# A run under ``stepwatch track`` (no aggregator, no history): 150 steps whose loader sleeps 15 ms
# a batch, as much as the forward (``explain`` names it INPUT_BOUND from the artifacts alone)
TRACK_STEPS = 150
TRACK_ARGS = ("--steps", str(TRACK_STEPS), "--forward-ms", "20", "--slow-loader-ms", "15")


def track_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the ``track`` run of TRACK_ARGS, made once per test session."""
    pytest.importorskip("torch")

    def build(base: Path) -> Path:
        out = base / "tracked"
        proc = subprocess.run([*STEPWATCH, "track", "--interval", "200", "--out", str(out), "--", sys.executable,
                               str(PROGRAM), *TRACK_ARGS], cwd=base, env=clean_env(), capture_output=True, text=True,
                              timeout=90)
        assert proc.returncode == 0, proc.stderr
        return out

    return once(tmp_path_factory, "track-run", build)
