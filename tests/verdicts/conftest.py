"""Real training runs under ``stepwatch run`` (CPU, gloo) that provoke each verdict, and the
commands that read them back (``summary``, ``explain``, ``compare``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

PROGRAM = Path(__file__).resolve().parent / "programs" / "verdict_train.py"
_script = shutil.which("stepwatch", path=str(Path(sys.executable).parent))
STEPWATCH = [_script] if _script else [sys.executable, "-m", "stepwatch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("STEPWATCH_", "FORCE_COLOR", "COLUMNS", "TTY_COMPATIBLE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def stepwatch(*args: str, cwd: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STEPWATCH, *args], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


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
        proc = stepwatch("explain", str(self.out), "--json", *args, cwd=self.out.parent)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


def train(base: Path, name: str, *args: str, nproc: int = 1, interval_ms: int = 200, timeout: float = 90,
          **env: str) -> Run:
    out = base / name
    command = [*STEPWATCH, "run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               "--interval", str(interval_ms), "--out", str(out), str(PROGRAM), *args]
    proc = subprocess.run(command, cwd=base, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Run(out, proc)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """``runs(name, *args, ...)``: the run of that name, trained once per test session."""
    base = tmp_path_factory.mktemp("verdict-runs")
    done: dict[str, Run] = {}

    def get(name: str, *args: str, **kwargs: Any) -> Run:
        if name not in done:
            done[name] = train(base, name, *args, **kwargs)
        return done[name]

    return get
