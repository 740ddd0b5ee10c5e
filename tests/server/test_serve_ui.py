"""``stepwatch serve --ui-port``: the aggregator serves the dashboard over its --out directory from
its own event loop, and says where in its ready line."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support import STEPWATCH, clean_env

pytestmark = pytest.mark.real


def test_serve_with_a_ui_port_answers_the_dashboard(tmp_path: Path) -> None:
    proc = subprocess.Popen([*STEPWATCH, "serve", "--out", str(tmp_path / "hub"), "--port", "0", "--ui-port", "0"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["ui"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{ready['ui']}api/runs", timeout=30) as response:
            body = json.loads(response.read())
        assert body["runs"] == [] and "no sessions under" in body["problems"][0]
        with urllib.request.urlopen(ready["ui"], timeout=30) as response:
            assert b"window.STEPWATCH" in response.read()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_run_with_a_remote_aggregator_has_no_dashboard_to_serve(tmp_path: Path) -> None:
    from tests.support import run_stepwatch

    (tmp_path / "train.py").write_text("print('never run')\n")
    proc = run_stepwatch("run", "--aggregator", "127.0.0.1:9", "--ui-port", "0", "--out", str(tmp_path / "run"),
                         "train.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--ui-port" in proc.stderr and "--aggregator" in proc.stderr
    assert not (tmp_path / "run").exists()
