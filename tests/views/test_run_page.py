"""The run page's data from a real SQLite history (rows written through the store, no process):
every rank's series within the points budget with its spike kept, the heatmap and phase shares,
the live cursor handing over only what is new, the runs list over a store of many sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwatch.store.sqlite import SqliteStore
from stepwatch.views.downsample import points_budget
from stepwatch.views.run_page import UPDATE_LIMIT, run_page, run_updates, step_spans
from stepwatch.views.runs import runs_list
from stepwatch.views.sources import Catalog, NoSuchSession, check_session_id
from tests.support.history import SPIKE, write_run


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("big") / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "big-run", 64, 3_000)
    return path, "big-run"


def test_a_64_rank_run_page_stays_within_budget_and_keeps_the_spike(big: tuple[Path, str]) -> None:
    path, session = big
    with SqliteStore(path, read_only=True) as store:
        page = run_page(store, session, None)
    series = page["step_time"]["series"]
    assert [s["rank"] for s in series] == list(range(64))
    budget = points_budget(64)
    assert all(0 < len(s["x"]) <= 2 * budget for s in series)
    spike_rank = series[SPIKE[0]]
    peak = max(spike_rank["y"])
    assert peak > 100 and spike_rank["x"][spike_rank["y"].index(peak)] == SPIKE[1]
    heat = page["heatmap"]
    assert len(heat["z"]) == 64 and max(max(v for v in row if v is not None) for row in heat["z"]) == peak
    shares = page["phases"]["shares"]
    for i in range(len(page["phases"]["x"])):
        assert sum(v[i] or 0 for v in shares.values()) == pytest.approx(1.0, abs=0.01)
    assert len(page["memory"]["series"]) == 64
    assert len(json.dumps(page, separators=(",", ":"))) < 2_000_000
    assert page["diagnosis"]["primary"] is not None


def test_updates_hand_over_only_what_is_new(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "live", 2, 50, status="running")
    with SqliteStore(path, read_only=True) as store:
        page = run_page(store, "live", None)
        assert page["cursor"]["steps"] == {"0": 49, "1": 49}
        nothing = run_updates(store, "live", None, page["cursor"])
        assert nothing["steps"] == [] and nothing["memory"] == [] and not nothing["reload"]
        partial = run_updates(store, "live", None, {**page["cursor"], "steps": {"0": 39, "1": 44}})
        assert [(s["rank"], s["x"]) for s in partial["steps"]] == [(0, list(range(40, 50))), (1, list(range(45, 50)))]
        assert partial["status"] == "running"
    with SqliteStore(path) as store:  # more steps than one poll hands over: the page reloads
        write_run(store, "live2", 1, UPDATE_LIMIT + 10, status="running")
    with SqliteStore(path, read_only=True) as store:
        assert run_updates(store, "live2", None, {"steps": {"0": 5}})["reload"] is True
        spans = step_spans(store, "live", 3)  # no spans stored: each rank's step itself
        assert [s["rank"] for s in spans["spans"]] == [0, 1] and spans["spans"][0]["name"] == "step"


def test_runs_list_over_a_store_of_many_sessions(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "history.sqlite") as store:
        for i in range(3):
            write_run(store, f"session-{i}", 1 + i, 20 + i)
    catalog = Catalog(tmp_path)
    listed = runs_list(catalog)
    assert listed["problems"] == []
    assert sorted((r["session_id"], r["ranks"], r["steps"]) for r in listed["runs"]) == [
        ("session-0", 1, 20), ("session-1", 2, 21), ("session-2", 3, 22)]
    with pytest.raises(NoSuchSession, match="no session nope"):
        catalog.locate("nope")


def test_a_damaged_store_is_a_problem_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "history.sqlite").write_bytes(b"\0garbage" * 512)
    listed = runs_list(Catalog(tmp_path))
    assert listed["runs"] == [] and len(listed["problems"]) == 1 and "cannot be read" in listed["problems"][0]


@pytest.mark.parametrize("bad", ["", "x" * 129, "a\nb", "\x00"])
def test_session_ids_are_checked_as_the_ingestion_path_checks_them(bad: str) -> None:
    with pytest.raises(ValueError, match="session id"):
        check_session_id(bad)


def test_a_history_from_before_the_verdict_and_alert_tables_still_draws(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "old", 2, 30)
    with sqlite3.connect(path) as db:  # as an older stepwatch wrote it: no verdicts, no alerts, no recompute_ns
        for table in ("verdicts", "alerts"):
            db.execute(f"DROP VIEW {table}")
            db.execute(f"DROP TABLE {table}_rows")
        (view,) = db.execute("SELECT sql FROM sqlite_master WHERE name = 'steps'").fetchone()
        db.execute("DROP VIEW steps")
        db.execute(view.replace(" recompute_ns,", "").replace(" r.recompute_ns,", ""))
    with SqliteStore(path, read_only=True) as store:
        page = run_page(store, "old", None)
    assert [len(s["x"]) for s in page["step_time"]["series"]] == [30, 30]
    assert page["verdicts"] == [] and page["alerts"] == []
    assert page["phases"]["shares"]["recompute"] == [0.0] * len(page["phases"]["x"])
    assert [r["session_id"] for r in runs_list(Catalog(tmp_path))["runs"]] == ["old"]
