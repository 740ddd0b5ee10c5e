"""A running run's page while its store changes at every write: the dashboard builds it again at
most once per few build times (the aggregator's writer shares the process), and never serves a
page of a run that has ended as running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stepwatch.store.sqlite import SqliteStore
from stepwatch.views.sources import Catalog
from stepwatch.web import app as web_app
from tests.support.history import write_run


def _stamp(path: Path) -> tuple[object, ...]:
    return web_app._stamp(path)


def test_a_running_page_is_reused_while_young_and_rebuilt_once_the_run_ends(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "live", 2, 50, status="running")
    dashboard = web_app.Dashboard(Catalog(tmp_path))
    first = dashboard._run_page("live")
    assert first["session"]["status"] == "running"
    before = _stamp(path)
    with SqliteStore(path) as store:  # the store changes under the open page (another session writes)
        write_run(store, "other", 1, 20, status="running")
    assert _stamp(path) != before  # so the stamped cache would build the page again
    assert dashboard._run_page("live") is first
    with SqliteStore(path) as store:
        store.upsert_session({"session_id": "live", "status": "completed", "started_at_ns": None, "ended_at_ns": None,
                              "host": None, "world_size": None, "source": None, "command_line": None})
    ended = dashboard._run_page("live")
    assert ended is not first and ended["session"]["status"] == "completed"


def test_an_old_running_page_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "live", 2, 50, status="running")
    monkeypatch.setattr(web_app, "_LIVE_REUSE_MIN_S", 0.05)
    monkeypatch.setattr(web_app, "_LIVE_REUSE_FACTOR", 0.0)
    dashboard = web_app.Dashboard(Catalog(tmp_path))
    first = dashboard._run_page("live")
    with SqliteStore(path) as store:
        write_run(store, "other", 1, 20, status="running")
    time.sleep(0.1)  # past the (shortened) reuse window: nothing to await, the clock is the rule
    assert dashboard._run_page("live") is not first


def test_a_finished_page_built_once_is_served_by_a_cold_dashboard(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "done", 4, 200)
    pages = tmp_path / "pages"
    first = web_app.Dashboard(Catalog(tmp_path), page_cache=pages)
    built = first._run_page("done")
    assert first.page_cache.misses == 1 and len(list(pages.glob("*.json.gz"))) == 1
    cold = web_app.Dashboard(Catalog(tmp_path), page_cache=pages)  # a later `stepwatch ui`
    assert cold._run_page("done") == built and cold.page_cache.hits == 1
    with SqliteStore(path) as store:  # the session gets more rows: built again, and kept again
        write_run(store, "done", 4, 50, first_step=200)
    colder = web_app.Dashboard(Catalog(tmp_path), page_cache=pages)
    assert colder._run_page("done")["session"]["steps"] == 250 and colder.page_cache.hits == 0
    assert web_app.Dashboard(Catalog(tmp_path), page_cache=pages)._run_page("done")["session"]["steps"] == 250


def test_no_page_cache_keeps_nothing(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "done", 2, 30)
    dashboard = web_app.Dashboard(Catalog(tmp_path), page_cache=False)
    assert dashboard._run_page("done")["session"]["steps"] == 30
    assert dashboard.page_cache.folder is None and dashboard.page_cache.hits == dashboard.page_cache.misses == 0


def test_a_report_keeps_its_page_for_the_next_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.web.report import write_report

    monkeypatch.setenv("STEPWATCH_CACHE_DIR", str(tmp_path / "cache"))
    with SqliteStore(tmp_path / "history.sqlite") as store:
        write_run(store, "done", 2, 40)
    write_report(tmp_path / "history.sqlite", tmp_path / "report.html", "done")  # as run --report does
    dashboard = web_app.Dashboard(Catalog(tmp_path))
    assert dashboard._run_page("done")["session"]["steps"] == 40
    assert dashboard.page_cache.hits == 1


def test_a_page_built_while_the_history_is_written_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.views import run_page as views_run_page

    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "done", 2, 30)
    build = views_run_page.run_page

    def build_while_another_run_writes(store: object, session: str, run_dir: Path | None) -> dict[str, object]:
        page = build(store, session, run_dir)  # the real build, then a write lands before it is kept
        with SqliteStore(path) as writer:
            write_run(writer, "other", 1, 10, status="running")
        return page

    monkeypatch.setattr(views_run_page, "run_page", build_while_another_run_writes)
    dashboard = web_app.Dashboard(Catalog(tmp_path), page_cache=tmp_path / "pages")
    assert dashboard._run_page("done")["session"]["steps"] == 30
    assert not list((tmp_path / "pages").glob("*.json.gz"))  # its key no longer says what it holds
