"""A run's page grows while it trains: ``stepwatch run --ui-port 0`` serves the dashboard from the
aggregator, the page polls for what is new and extends its charts in place (no reload), and a
new alert appears as it happens."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import STEPWATCH, clean_env
from tests.support.browser import open_page
from tests.support.web_runs import PROGRAM

pytestmark = pytest.mark.real

_DASHBOARD = re.compile(r"\[stepwatch\] dashboard: (http://\S+)")


# the points the step-time chart draws, as the page describes it (tests.support.browser.charts)
_STEP_POINTS_JS = "() => ((window.stepwatchCharts && window.stepwatchCharts()['chart-step']) || []).reduce((n, s) => n + s.points, 0)"


def _step_points(page: Any) -> int:
    return int(page.evaluate(_STEP_POINTS_JS))


def test_a_live_run_page_grows_without_a_reload(browser: Any, tmp_path: Path, shots: Path) -> None:
    pytest.importorskip("torch")
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([*STEPWATCH, "run", "--ui-port", "0", "--interval", "200", "--out", str(tmp_path / "run"),
                                 str(PROGRAM), "--steps", "240", "--sleep-after-step-ms", "40", "--nan-at", "150"],
                                cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            deadline = time.monotonic() + 90
            url = None
            while url is None and time.monotonic() < deadline and proc.poll() is None:
                found = _DASHBOARD.search(log_path.read_text())
                url = found.group(1) if found else None
                time.sleep(0.1)
            assert url is not None, log_path.read_text()
            page, log = open_page(browser, url)
            assert page.is_visible("#live")
            page.evaluate("() => { window.loadedOnce = 'yes'; }")
            page.wait_for_function(f"() => ({_STEP_POINTS_JS})() >= 20", timeout=60_000)
            first = _step_points(page)
            page.wait_for_function(f"() => ({_STEP_POINTS_JS})() > {first + 30}", timeout=60_000)
            assert page.evaluate("() => window.loadedOnce") == "yes"  # grown in place: the same document
            assert int(page.evaluate("() => document.body.dataset.polls || '0'")) >= 1
            # the NONFINITE alert of step 150 arrives while the page is open
            page.wait_for_selector("#alerts-body tr", timeout=60_000)
            assert "NONFINITE" in page.inner_text("#alerts-body")
            page.screenshot(path=str(shots / "run-live.png"), full_page=True)
            # the run ends: the page takes its final data once and stops polling
            page.wait_for_selector("#live", state="hidden", timeout=90_000)
            page.wait_for_function("() => document.getElementById('outcome').textContent !== 'running'",
                                   timeout=30_000)
            assert page.evaluate("() => window.loadedOnce") == "yes"
            assert log.errors == [] and log.off_machine() == []
        finally:
            proc.wait(timeout=120)
    assert proc.returncode == 0, log_path.read_text()[-3000:]
