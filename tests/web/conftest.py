"""Real runs for the dashboard's browser tests, trained once per test session (the xdist workers
share them through a lock file: the first worker to ask trains, the others wait and reuse), a
Chromium per worker, and a ``stepwatch ui`` over the runs' directory."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import STEPWATCH, clean_env, free_port
from tests.support.browser import CHROMIUM_ARGS, require_chromium

PROGRAM = Path(__file__).resolve().parent / "programs" / "train_web.py"
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


@pytest.fixture(scope="session")
def web_runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict[str, Path]:
    """name -> run directory of each run of RUNS (one directory holds them all: ``runs_root``)."""
    pytest.importorskip("torch")
    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    base = shared / "web-runs"
    marker = shared / "web-runs.json"
    with open(shared / "web-runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            base.mkdir(exist_ok=True)
            marker.write_text(json.dumps(_train_all(base)))
    done = json.loads(marker.read_text())
    for name in ("clean", "straggler"):
        assert done[name]["code"] == 0, done[name]["output"]
    return {name: Path(run["dir"]) for name, run in done.items()}


@pytest.fixture(scope="session")
def runs_root(web_runs: dict[str, Path]) -> Path:
    return next(iter(web_runs.values())).parent


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """One Chromium for the package's tests on a worker. Not a session's: Playwright's sync API
    keeps an asyncio loop running on the worker's thread while it is open, and every later test
    of that worker that calls ``asyncio.run`` would fail."""
    chromium = require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        found = p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        yield found
        found.close()


class Server:
    """A ``stepwatch ui`` process and its URL."""

    def __init__(self, path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*STEPWATCH, "ui", str(path), "--port", "0", *args], env=clean_env(**(env or {})),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"stepwatch ui did not start: {self.proc.communicate(timeout=10)[1]}")
        self.url: str = json.loads(line)["url"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="session")
def dashboard(runs_root: Path) -> Iterator[Server]:
    server = Server(runs_root)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests save their screenshots: $STEPWATCH_SCREENSHOTS (docs/dashboard.md's images
    are made with it set to docs/images), else a folder of the test session."""
    named = os.environ.get("STEPWATCH_SCREENSHOTS")
    folder = Path(named) if named else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "final_summary.json").read_text())

