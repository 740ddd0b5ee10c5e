"""The dashboard's browser tests: the shared real runs (tests/support/web_runs.py), a Chromium
per worker, and a ``stepwatch ui`` over the runs' directory."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import STEPWATCH, clean_env
from tests.support.browser import CHROMIUM_ARGS, require_chromium
from tests.support.web_runs import web_runs as shared_web_runs


@pytest.fixture(scope="session")
def web_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> run directory of each run of tests/support/web_runs.py's RUNS (one directory holds
    them all: ``runs_root``)."""
    return shared_web_runs(tmp_path_factory)


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

