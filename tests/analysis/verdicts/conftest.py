"""Real training runs under ``stepwatch run`` (CPU, gloo) that provoke each verdict, and the
commands that read them back (``summary``, ``explain``, ``compare``)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import STEPWATCH, clean_env, free_port, run_stepwatch
from tests.support.shared import once
from tests.support.web_runs import PROGRAM, web_run_outputs

pytest.importorskip("torch")


class Run:
    """One finished ``stepwatch run`` of the verdict program."""

    def __init__(self, out: Path, proc: subprocess.CompletedProcess[str]) -> None:
        self.out = out
        self.proc = proc

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "final_summary.json").read_text())

    @property
    def diagnosis(self) -> dict[str, Any]:
        return self.summary["diagnosis"]

    def explain(self, *args: str) -> dict[str, Any]:
        proc = run_stepwatch("explain", str(self.out), "--json", *args, cwd=self.out.parent)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


def train(base: Path, name: str, *args: str, interval_ms: int = 200, timeout: float = 90, ranks: int = 1,
          **env: str) -> Run:
    out = base / name
    command = [*STEPWATCH, "run", "--interval", str(interval_ms), "--out", str(out)]
    if ranks > 1:
        command += ["--nproc-per-node", str(ranks), "--master-port", str(free_port())]
    command += [str(PROGRAM), *args]
    proc = subprocess.run(command, cwd=base, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Run(out, proc)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """``runs(name, *args, ...)``: the run of that name, trained once per test session, whichever
    worker asks first (the same name always asks for the same run)."""

    def get(name: str, *args: str, **kwargs: Any) -> Run:
        return once(tmp_path_factory, f"verdict-{name}", lambda base: train(base, name, *args, **kwargs))

    return get


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The two 2-rank runs every surface reads (tests/support/web_runs.py), ``clean`` and
    ``straggler``, as verdict runs."""
    done = web_run_outputs(tmp_path_factory)
    return {name: Run(Path(done[name]["dir"]), subprocess.CompletedProcess([], done[name]["code"], done[name]["stdout"],
                                                                          done[name]["stderr"]))
            for name in ("clean", "straggler")}
