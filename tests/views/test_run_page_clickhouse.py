"""The dashboard's views on a ClickHouse store (Debian's 18.16 server) against the same run on
SQLite: the session-shared two-rank run imported into both (tests/support/clickhouse.py), then
every view's JSON compared. The reads SQLite answers with SQL of its own (the rank extents, the
step and phase buckets, the memory chart's buckets) are compared at widths the small run's page
would not use, so every bucket path runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from stepwatch.views import run_page as views
from stepwatch.views.compare_page import compare_page
from stepwatch.views.runs import runs_list
from stepwatch.views.sources import Catalog
from tests.support.clickhouse import imported_trace_run
from tests.support.store_compare import both_stores

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def imported(clickhouse_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return imported_trace_run(tmp_path_factory, clickhouse_server)


@pytest.fixture
def both(imported: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    yield from both_stores(imported["sqlite"], imported["url"])


def test_the_run_page_spans_and_updates_equal_sqlites(both: tuple[Any, Any], imported: dict[str, Any]) -> None:
    sqlite, ch = both
    sid = imported["session_id"]
    page = views.run_page(sqlite, sid, None)
    assert views.run_page(ch, sid, None) == page
    assert len(page["step_time"]["series"]) == 2 and page["memory"]["series"] and page["epochs"], page["problems"]
    assert page["diagnosis"].get("primary") is not None and not page["problems"]
    assert views.step_spans(ch, sid, page["slowest_step"]) == views.step_spans(sqlite, sid, page["slowest_step"])
    # live growth: from the page's own cursor (nothing new) and from five steps back on each rank
    earlier = {**page["cursor"], "steps": {r: last - 5 for r, last in page["cursor"]["steps"].items()},
               "memory_ns": page["cursor"]["memory_ns"] - 10**9, "alerts": 0, "verdicts": 0}
    for cursor in (page["cursor"], earlier):
        assert views.run_updates(ch, sid, None, cursor) == views.run_updates(sqlite, sid, None, cursor)
    grown = views.run_updates(ch, sid, None, earlier)
    assert [len(s["x"]) for s in grown["steps"]] == [5, 5]


def test_every_bucket_read_equals_sqlites(both: tuple[Any, Any], imported: dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    sqlite, ch = both
    sid = imported["session_id"]
    extents = views.last_steps(sqlite, sid)
    assert views.last_steps(ch, sid) == extents and len(extents) == 2
    first = min(a for a, _ in extents.values())
    last = max(b for _, b in extents.values())
    ranks = sorted(extents)
    for width in (1, 3, 7):
        n = (last - first) // width + 1
        assert views._step_buckets(ch, sid, ranks, first, width, n) == views._step_buckets(sqlite, sid, ranks, first,
                                                                                             width, n)
        assert views._phase_buckets(ch, sid, ranks, first, width, n) == views._phase_buckets(sqlite, sid, ranks, first,
                                                                                               width, n)
    t0 = sqlite.sessions()[0]["started_at_ns"]
    assert views._memory(ch, sid, t0) == views._memory(sqlite, sid, t0)  # the samples as they are
    for buckets in (3, 10):  # the buckets' lowest and highest sample, cut in SQL (the run has 62 a rank)
        monkeypatch.setattr(views, "points_budget", lambda _series, _total=0, n=buckets: n)
        memory = views._memory(ch, sid, t0)
        assert memory == views._memory(sqlite, sid, t0)
        assert 0 < max(len(s["t"]) for s in memory[0]) <= 2 * buckets


def test_the_runs_and_compare_pages_of_a_url_equal_sqlites(imported: dict[str, Any]) -> None:
    sid = imported["session_id"]
    on_url, on_file = Catalog(imported["url"]), Catalog(imported["sqlite"])
    try:
        listed = runs_list(on_url)
        assert "@" in listed["path"] and listed["path"].startswith("clickhouse://")
        assert listed["runs"] == runs_list(on_file)["runs"] and [r["session_id"] for r in listed["runs"]] == [sid]
        assert on_url.default_session() == sid
        assert compare_page(on_url, sid, sid) == compare_page(on_file, sid, sid)
    finally:
        on_url.close()
        on_file.close()
