"""The one-file report: written by ``stepwatch report`` and ``run --report``, opened as file://
in Chromium with no server: it draws the run page's charts from the data inside it, asks for
nothing (every request it makes is the file itself), and states the same verdict."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_stepwatch
from tests.support.browser import charts, open_page

from .conftest import summary_of

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def report(web_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "straggler.html"
    proc = run_stepwatch("report", str(web_runs["straggler"]), "-o", str(out), cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    return out


def test_the_report_is_one_file_with_nothing_to_fetch(report: Path) -> None:
    text = report.read_text()
    assert report.stat().st_size < 5 * 2**20
    # no script, style, image or frame from elsewhere: every element's source is inside the file
    assert re.findall(r"""<(?:script|link|img|iframe)[^>]+(?:src|href)=["'](?!data:)[^"']+""", text) == []
    outside = re.sub(r'<script type="application/octet-stream"[^>]*>[^<]*</script>', "", text)
    # the addresses left are in comments only (uPlot's licence notice and its banner): nothing fetches them
    comments = re.findall(r"<!--.*?-->|/\*!.*?\*/", outside, flags=re.S)
    assert any("MIT License" in c and "Leon Sorokin" in c for c in comments)  # the library's licence travels with it
    code = re.sub(r"<!--.*?-->|/\*!.*?\*/", "", outside, flags=re.S)
    assert "https://" not in code and "http://" not in code
    assert report.stat().st_size < 400_000  # a small run's report: the library is 51 KB, no more Plotly


def test_the_report_opens_as_a_file_and_draws_the_run(browser: Any, report: Path, web_runs: dict[str, Path],
                                                      shots: Path) -> None:
    summary = summary_of(web_runs["straggler"])
    page, log = open_page(browser, report.as_uri())
    page.wait_for_selector("body[data-spans]", state="attached", timeout=30_000)
    drawn = charts(page)
    expected = {f"rank {rank}": stats["steps"] for rank, stats in summary["per_rank"].items()}
    assert {t["name"]: t["points"] for t in drawn["chart-step"]} == expected
    assert set(drawn) >= {"chart-step", "chart-heatmap", "chart-phases", "chart-memory", "chart-marks", "chart-spans"}
    assert page.inner_text("#verdict-name") == summary["diagnosis"]["primary"]["name"]
    assert summary["session_id"] in page.inner_text("#environment")
    assert page.inner_text("#outcome") == "succeeded"
    assert f"stepwatch summary  session {summary['session_id']}" in page.inner_text("#summary")
    assert log.errors == []
    assert log.requests == [report.as_uri()]
    page.screenshot(path=str(shots / "report.png"), full_page=True)
