"""``stepwatch ui clickhouse://...`` in a real browser over Debian's 18.16 server: the runs page
lists the database's session, its run page draws what the same run's page on SQLite holds
(tests/views/test_run_page_clickhouse.py compares the JSON), and the compare page and the live
updates answer, and ``report`` writes its one file. The session-shared two-rank run imported once (tests/support/clickhouse.py)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

import pytest

from tests.support.browser import charts, open_page
from tests.support.clickhouse import imported_trace_run

from .conftest import Server

pytestmark = pytest.mark.real


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def test_the_dashboard_of_a_url_lists_draws_and_compares_its_sessions(
        browser: Any, clickhouse_server: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    imported = imported_trace_run(tmp_path_factory, clickhouse_server)
    sid = imported["session_id"]
    cache = tmp_path_factory.mktemp("url-page-cache")
    server = Server(imported["url"], env={"STEPWATCH_CACHE_DIR": str(cache)})
    try:
        runs = _get(f"{server.url}api/runs")
        assert [r["session_id"] for r in runs["runs"]] == [sid] and runs["path"].startswith("clickhouse://")
        assert runs["runs"][0]["ranks"] == 2 and runs["runs"][0]["steps"] >= 20, runs
        page, log = open_page(browser, f"{server.url}run/{sid}")
        page.wait_for_selector("body[data-spans]", state="attached", timeout=30_000)
        drawn = charts(page)
        data = _get(f"{server.url}api/run/{sid}")
        assert {t["name"]: t["points"] for t in drawn["chart-step"]} == {
            f"rank {s['rank']}": len(s["x"]) for s in data["step_time"]["series"]}
        assert drawn["chart-heatmap"][0]["rows"] == 2
        assert {t["name"] for t in drawn["chart-spans"]} >= {"forward", "backward"}
        assert page.inner_text("#verdict-name") == data["diagnosis"]["primary"]["name"]
        assert log.errors == [] and log.off_machine() == []
        # nothing new since the page's cursor; the compare page of the session against itself
        cursor = urllib.parse.quote(json.dumps(data["cursor"]))
        assert _get(f"{server.url}api/run/{sid}/updates?cursor={cursor}")["steps"] == []
        compared = _get(f"{server.url}api/compare?a={sid}&b={sid}")
        assert compared["verdict"]["verdict"] == "EQUIVALENT" and len(compared["a"]["step_time"]["series"]) == 2
    finally:
        server.stop()
    assert not list(cache.rglob("*.json.gz"))  # no page kept for a URL
    # the one-file report of the session, from the URL
    from stepwatch.web.report import build_report

    html = build_report(imported["url"], sid)
    assert f"stepwatch report: {sid}" in html and 'id="sw-data"' in html
