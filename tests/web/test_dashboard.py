"""The dashboard in a real browser (Chromium under Playwright) over real runs: what each page
draws, as the page describes its charts (window.stepwatchCharts) and as the heatmap's pixels
show it, what pointing at a chart reads out, the verdict and alerts it shows, no console error,
no request off this machine; screenshots for docs/dashboard.md."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import charts, open_page

from .conftest import Server, summary_of

pytestmark = pytest.mark.real


def _clean(log: Any) -> None:
    assert log.errors == []
    assert log.off_machine() == []


def _steps_per_rank(run_dir: Path) -> dict[str, int]:
    return {rank: stats["steps"] for rank, stats in summary_of(run_dir)["per_rank"].items()}


def test_runs_page_lists_every_run_sortable_and_filterable(browser: Any, dashboard: Server,
                                                           web_runs: dict[str, Path], shots: Path) -> None:
    page, log = open_page(browser, dashboard.url)
    rows = page.locator("#runs tbody tr")
    assert rows.count() == len(web_runs)
    ids = {summary_of(d)["session_id"] for d in web_runs.values() if (d / "final_summary.json").exists()}
    shown = set(page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.session)"))
    assert ids <= shown
    straggler = summary_of(web_runs["straggler"])
    row = page.locator(f"#runs tbody tr[data-session='{straggler['session_id']}']")
    assert straggler["diagnosis"]["primary"]["name"] in row.inner_text()
    page.screenshot(path=str(shots / "runs.png"), full_page=True)
    # the link holds the session id
    assert row.locator("a").get_attribute("href") == f"/run/{straggler['session_id']}"
    # filter: only the straggler's row stays
    page.fill("#filter", straggler["session_id"][:13])
    assert page.locator("#runs tbody tr").count() == 1
    page.fill("#filter", "")
    # sort by steps, ascending then descending
    page.click("th[data-key='steps']")
    ascending = [int(t) for t in page.locator("#runs tbody td.c-steps").all_inner_texts()]
    assert ascending == sorted(ascending)
    page.click("th[data-key='steps']")
    descending = [int(t) for t in page.locator("#runs tbody td.c-steps").all_inner_texts()]
    assert descending == sorted(ascending, reverse=True)
    # tick two runs: the compare link names both
    clean = summary_of(web_runs["clean"])["session_id"]
    assert page.is_hidden("#compare-link")
    for session in (clean, straggler["session_id"]):
        page.check(f"#runs tbody input[data-session='{session}']")
    assert page.get_attribute("#compare-link", "href") == f"/compare?a={clean}&b={straggler['session_id']}"
    page.click("#compare-link")
    page.wait_for_selector("#compare-verdict")
    _clean(log)


def test_straggler_run_page_draws_every_rank_and_names_the_slow_one(browser: Any, dashboard: Server,
                                                                   web_runs: dict[str, Path], shots: Path) -> None:
    run_dir = web_runs["straggler"]
    summary = summary_of(run_dir)
    page, log = open_page(browser, f"{dashboard.url}run/{summary['session_id']}")
    page.wait_for_selector("body[data-spans]", state="attached", timeout=30_000)
    drawn = charts(page)
    steps = _steps_per_rank(run_dir)
    # a series per rank, with one point per step (few steps: no bucketing)
    assert {t["name"]: t["points"] for t in drawn["chart-step"]} == {f"rank {r}": n for r, n in steps.items()}
    assert drawn["chart-heatmap"][0]["rows"] == 2
    assert len([t for t in drawn["chart-memory"] if t["type"] == "line"]) >= 2
    assert any(t["name"].startswith("loss (inferred)") for t in drawn["chart-marks"])
    assert {t["name"] for t in drawn["chart-spans"]} >= {"forward", "backward"}
    assert {t["name"] for t in drawn["chart-phases"]} >= {"forward", "backward"}
    primary = summary["diagnosis"]["primary"]
    assert page.inner_text("#verdict-name") == primary["name"]
    assert page.inner_text("#verdict-message") == primary["message"]
    assert "STRAGGLER" in primary["name"] and primary["ranks"] == [1]
    page.screenshot(path=str(shots / "run-straggler.png"), full_page=True)
    page.screenshot(path=str(shots / "dashboard.png"))  # the top of the page: the README's picture
    # another step's spans on demand
    page.fill("#spans-step", "3")
    page.click("#spans-go")
    page.wait_for_selector("body[data-spans='3']", state="attached")
    _clean(log)


def test_crashed_run_page_says_how_it_ended_and_shows_its_alerts(browser: Any, dashboard: Server,
                                                                web_runs: dict[str, Path], shots: Path) -> None:
    run_dir = web_runs["crashed"]
    summary = summary_of(run_dir)
    page, log = open_page(browser, f"{dashboard.url}run/{summary['session_id']}")
    assert page.inner_text("#outcome") == summary["outcome"] == "failed"
    assert "RuntimeError" in page.inner_text("#run-error")
    drawn = charts(page)
    assert [t["points"] for t in drawn["chart-step"]] == [summary["per_rank"]["0"]["steps"]]
    # the memory chart marks the alert (and the failure) on its time axis
    markers = [t for t in drawn["chart-memory"] if t["type"] == "markers"]
    assert len(markers) == 1 and "alert" in markers[0]["kinds"]
    alerts = summary["alerts"]
    assert any(a["kind"] == "NONFINITE" for a in alerts)
    shown = page.locator("#alerts-body tr").all_inner_texts()
    assert len(shown) == len(alerts)
    assert any("NONFINITE" in row for row in shown)
    page.screenshot(path=str(shots / "run-crashed.png"), full_page=True)
    _clean(log)


def test_killed_run_page_draws_what_was_recorded(browser: Any, dashboard: Server, web_runs: dict[str, Path]) -> None:
    run_dir = web_runs["killed"]
    session = json.loads((run_dir / "run.json").read_text())
    page, log = open_page(browser, f"{dashboard.url}run/{session['session_id']}")
    assert page.inner_text("#outcome") == session["outcome"]
    drawn = charts(page)
    assert len(drawn["chart-step"]) == 1 and 0 < drawn["chart-step"][0]["points"] <= 25
    _clean(log)


def test_compare_page_overlays_two_runs_with_the_compare_verdict(browser: Any, dashboard: Server,
                                                                 web_runs: dict[str, Path], shots: Path) -> None:
    a, b = summary_of(web_runs["clean"]), summary_of(web_runs["straggler"])
    page, log = open_page(browser, f"{dashboard.url}compare?a={a['session_id']}&b={b['session_id']}")
    from stepwatch.analysis.compare import compare_verdict

    expected = compare_verdict(a, b, workload_a="small_train.py", workload_b="small_train.py")["verdict"]
    assert page.inner_text("#verdict-name") == expected
    names = [t["name"] for t in charts(page)["chart-compare"]]
    assert names == ["A rank 0", "A rank 1", "B rank 0", "B rank 1"]
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    _clean(log)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_and_unknown_session_ids_are_clear_errors(browser: Any, dashboard: Server) -> None:
    status, body = _get(f"{dashboard.url}api/run/{'x' * 200}")
    assert status == 400 and "session id" in body["error"]
    status, body = _get(f"{dashboard.url}api/run/no-such-session")
    assert status == 404 and "no session no-such-session" in body["error"]
    status, body = _get(f"{dashboard.url}api/run/abc/updates?cursor=%7B%22steps%22%3A%7B%22x%22%3A1%7D%7D")
    assert status == 400 and "rank" in body["error"]
    page, log = open_page(browser, f"{dashboard.url}run/no-such-session")
    assert "no session no-such-session" in page.inner_text("#message")
    assert log.off_machine() == []


def test_damaged_and_empty_stores_get_a_clear_message(browser: Any, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "history.sqlite").write_bytes(b"this is not a database" * 100)
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, words in ((damaged, "cannot be read"), (empty, "no sessions under")):
        server = Server(folder)
        try:
            page, log = open_page(browser, server.url)
            assert words in page.inner_text("#message")
            assert page.locator("#runs tbody tr").count() == 0
            assert all("Traceback" not in e for e in log.errors)
        finally:
            server.stop()


def test_a_token_guards_the_dashboard(web_runs: dict[str, Path], runs_root: Path) -> None:
    server = Server(runs_root, "--token-env", "UI_TOKEN", env={"UI_TOKEN": "s3cret-token"})
    try:
        assert _get(f"{server.url}api/runs")[0] == 401
        assert _get(f"{server.url}api/runs", {"Authorization": "Bearer wrong"})[0] == 401
        status, body = _get(f"{server.url}api/runs", {"Authorization": "Bearer s3cret-token"})
        assert status == 200 and len(body["runs"]) == len(web_runs)
        with urllib.request.urlopen(f"{server.url}?token=s3cret-token", timeout=30) as response:
            assert "stepwatch_token=" in response.headers["Set-Cookie"]
    finally:
        server.stop()


def test_the_page_loads_uplot_from_the_server_with_its_licence(dashboard: Server) -> None:
    with urllib.request.urlopen(dashboard.url, timeout=30) as response:
        page = response.read().decode()
    assert '<script src="/static/uPlot.iife.min.js" defer></script>' in page and "plotly" not in page.lower()
    with urllib.request.urlopen(f"{dashboard.url}static/uPlot.iife.min.js", timeout=30) as response:
        script = response.read()
    assert script.startswith(b"/*! https://github.com/leeoniya/uPlot (v1.6.32) */") and len(script) < 100_000
    with urllib.request.urlopen(f"{dashboard.url}static/uPlot.LICENSE", timeout=30) as response:
        licence = response.read().decode()
    assert "The MIT License" in licence and "Leon Sorokin" in licence
    request = urllib.request.Request(f"{dashboard.url}static/uPlot.iife.min.js", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Encoding"] == "gzip" and len(response.read()) < len(script) / 2


def test_a_network_bind_without_a_token_is_refused(runs_root: Path) -> None:
    from tests.support import run_stepwatch

    proc = run_stepwatch("ui", str(runs_root), "--host", "0.0.0.0", "--port", "0", cwd=runs_root)
    assert proc.returncode == 2
    assert "needs a token" in proc.stderr


# each heatmap row's mean luminance, read from the canvas's pixels along the row's middle
_ROW_LUMINANCE_JS = """(id) => {
  const chart = window.stepwatchCharts()[id][0], g = chart.plot, r = g.ratio;
  const ctx = document.querySelector('#' + id + ' canvas').getContext('2d');
  const out = [];
  for (let row = 0; row < chart.rows; row++) {
    const d = ctx.getImageData(Math.ceil(g.left * r), Math.floor((g.top + (row + 0.5) * g.rowH) * r), Math.floor(g.width * r) - 1, 1).data;
    let sum = 0;
    for (let i = 0; i < d.length; i += 4) sum += 0.2126 * d[i] + 0.7152 * d[i + 1] + 0.0722 * d[i + 2];
    out.push(sum / (d.length / 4));
  }
  return out;
}"""


def _point_at(page: Any, selector: str, x: float, y: float) -> str:
    """The chart's readout after the pointer moves to (x, y), in CSS pixels from its canvas's corner."""
    page.locator(selector).scroll_into_view_if_needed()
    box = page.locator(selector).bounding_box()
    page.mouse.move(box["x"] + x, box["y"] + y)
    return page.inner_text(selector.split(" ")[0] + "-readout")


SLOW_RANK = 17


def test_a_64_rank_run_draws_every_rank_downsampled(browser: Any, tmp_path: Path, shots: Path) -> None:
    from stepwatch.store.sqlite import SqliteStore
    from tests.support.history import SPIKE, write_run

    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "wide-run", 64, 3_000, slow_rank=SLOW_RANK)
    server = Server(tmp_path)
    try:
        status, data = _get(f"{server.url}api/run/wide-run")
        assert status == 200
        page, log = open_page(browser, f"{server.url}run/wide-run")
        drawn = charts(page)
        # what the server sent is what is drawn: a trace per rank, each downsampled the same way
        sent = {f"rank {s['rank']}": len(s["x"]) for s in data["step_time"]["series"]}
        assert {t["name"]: t["points"] for t in drawn["chart-step"]} == sent
        assert len(sent) == 64 and all(n < 3_000 for n in sent.values())
        assert drawn["chart-heatmap"][0]["rows"] == 64
        assert drawn["chart-heatmap"][0]["points"] == len(data["heatmap"]["x"])
        spike = next(s for s in data["step_time"]["series"] if s["rank"] == SPIKE[0])
        assert spike["x"][spike["y"].index(max(spike["y"]))] == SPIKE[1]  # the slow step survives
        assert f"each bucket of {data['step_time']['width']} steps" in page.inner_text("#step-note")
        # the straggler's row is drawn darker (hotter) than every other row, by far
        luminance = page.evaluate(_ROW_LUMINANCE_JS, "chart-heatmap")
        assert len(luminance) == 64
        others = [v for rank, v in enumerate(luminance) if rank != SLOW_RANK]
        assert luminance[SLOW_RANK] < min(others) - 40, (luminance[SLOW_RANK], min(others))
        # pointing at its row reads its rank and time out
        geometry = drawn["chart-heatmap"][0]["plot"]
        text = _point_at(page, "#chart-heatmap canvas", geometry["left"] + geometry["width"] / 2,
                         geometry["top"] + (SLOW_RANK + 0.5) * geometry["rowH"])
        assert text.startswith(f"rank {SLOW_RANK} · steps ") and " ms" in text
        # pointing at the step chart's line names the rank nearest the pointer, its step and time
        text = _point_at(page, "#chart-step .u-over", 200, 5)
        assert text.startswith("step ") and " · rank " in text and text.endswith(" ms"), text
        page.screenshot(path=str(shots / "run-64-ranks.png"), full_page=True)
        _clean(log)
    finally:
        server.stop()


def test_a_run_with_no_steps_yet_says_so_and_draws_empty_charts(browser: Any, tmp_path: Path) -> None:
    from stepwatch.store.sqlite import SqliteStore

    with SqliteStore(tmp_path / "history.sqlite") as store:  # a run that has sent its session and nothing else
        store.upsert_session({"session_id": "empty-run", "status": "completed", "started_at_ns": None, "ended_at_ns": None,
                              "host": "test", "world_size": 1, "source": "test", "command_line": ["train.py"]})
    server = Server(tmp_path)
    try:
        page, log = open_page(browser, f"{server.url}run/empty-run")
        assert "no steps recorded in this session" in page.inner_text("#message")
        drawn = charts(page)
        assert drawn["chart-step"] == [] and drawn["chart-heatmap"][0]["rows"] == 0
        _clean(log)
    finally:
        server.stop()
