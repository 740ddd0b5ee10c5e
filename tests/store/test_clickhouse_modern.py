"""The modern DDL (DateTime64, LowCardinality, CODEC, TTL retention) on a current ClickHouse:
chdb, ClickHouse 26.x in-process (the only current engine this machine can run; Debian's server
is 18.16). The session's real two-rank run imported into a chdb store and into a history.sqlite,
then every view, SqlReads read, analysis input, summary and named question asked of both. No
mock: without chdb these tests skip (fail under STEPWATCH_REQUIRE_CLICKHOUSE=1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch.store.base import COLUMNS
from stepwatch.store.importers import import_path
from stepwatch.store.sqlite import SqliteStore
from tests.support.clickhouse import require_chdb
from tests.support.store_compare import SELECTS, check_retention, named_answers
from tests.support.trace_run import STEPS_PER_RANK, trace_run

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def chdb_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One chdb data directory for the module (a process opens a directory once)."""
    require_chdb()
    return str(tmp_path_factory.mktemp("chdb"))


@pytest.fixture(scope="module")
def stores(chdb_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SqliteStore, Any]]:
    """The session's real run imported into a history.sqlite and (twice: idempotent) into a chdb
    store made from the modern DDL."""
    from stepwatch.store.clickhouse import ClickHouseStore

    run_dir = trace_run(tmp_path_factory)
    sqlite = SqliteStore(tmp_path_factory.mktemp("modern-sqlite") / "history.sqlite")
    ch = ClickHouseStore.on_chdb(chdb_dir, "imported")
    try:
        assert import_path(run_dir, sqlite) == import_path(run_dir, ch)
        import_path(run_dir, ch)
        yield sqlite, ch
    finally:
        sqlite.close()
        ch.close()


def test_the_server_is_current_and_its_tables_use_the_modern_types(stores: tuple[SqliteStore, Any]) -> None:
    _, ch = stores
    assert ch.features.modern and ch.features.version >= (26,)
    types = {(t, c): k for t, c, k in ch.query_tuples(
        "SELECT table, name, type FROM system.columns WHERE database = 'imported'")}
    assert types[("steps_rows", "start_ns")] == "Nullable(DateTime64(9, 'UTC'))"
    assert types[("telemetry_rows", "timestamp_ns")] == "DateTime64(9, 'UTC')"
    assert types[("telemetry_rows", "event_type")] == "LowCardinality(String)"
    assert types[("spans_rows", "name")] == "LowCardinality(Nullable(String))"
    codecs = {(t, c): k for t, c, k in ch.query_tuples(
        "SELECT table, name, compression_codec FROM system.columns WHERE database = 'imported'")}
    assert "DoubleDelta" in codecs[("telemetry_rows", "timestamp_ns")]
    assert "Gorilla" in codecs[("marks_rows", "value_num")]
    (create,), = ch.query_tuples("SELECT create_table_query FROM system.tables WHERE database = 'imported' "
                                 "AND name = 'steps_rows'")
    assert "TTL" in create and "retention_cutoffs_dict" in create
    for table in COLUMNS:  # every view: SQLite's columns, SQLite's types (times as epoch ns)
        names = [c for c, _ in COLUMNS[table]]
        view = {c: k for t, c, k in ch.query_tuples(
            "SELECT table, name, type FROM system.columns WHERE database = 'imported'") if t == table}
        assert list(view) == names, table
        assert not any("DateTime" in k or "LowCardinality" in k for k in view.values()), (table, view)


@pytest.mark.parametrize("sql", SELECTS)
def test_the_same_select_gives_the_same_rows(stores: tuple[SqliteStore, Any], sql: str) -> None:
    sqlite, ch = stores
    expected = sqlite.query(sql)
    assert expected or "no-such" in sql
    assert ch.query(sql) == expected


def test_every_read_the_analysis_sends_gives_sqlite_answers(stores: tuple[SqliteStore, Any]) -> None:
    from stepwatch.analysis.summary import build_summary
    from stepwatch.analysis.verdicts.inputs import load_verdict_inputs

    sqlite, ch = stores
    (session,) = sqlite.sessions()
    sid = session["session_id"]
    assert ch.sessions() == sqlite.sessions()
    for table in COLUMNS:
        assert ch.count(table, sid) == sqlite.count(table, sid), table
    assert ch.step_rows(sid) == sqlite.step_rows(sid) and len(ch.step_rows(sid)) == 2 * STEPS_PER_RANK
    assert ch.memory_peaks(sid) == sqlite.memory_peaks(sid)
    assert ch.step_aggregates(sid) == sqlite.step_aggregates(sid)
    for window in (None, 8):
        a, b = load_verdict_inputs(sqlite, sid, last_steps=window), load_verdict_inputs(ch, sid, last_steps=window)
        assert [dict(r) for r in a.steps] == [dict(r) for r in b.steps] and a[1:] == b[1:]
    assert build_summary(ch, sid) == build_summary(sqlite, sid)  # the diagnosis included


def test_named_questions_give_sqlite_rows(stores: tuple[SqliteStore, Any]) -> None:
    sqlite, ch = stores
    for name, expected, got in named_answers(sqlite.path, ch):
        assert got == expected, name


def test_retention_by_partition_drops_and_ttl(chdb_dir: str, tmp_path: Path) -> None:
    """The same window as SQLite's: the day with nothing in its window dropped whole, the rest
    deleted by the tables' TTL rule (``MATERIALIZE TTL``), no ``DELETE`` mutation."""
    from stepwatch.store.clickhouse import ClickHouseStore

    sqlite = SqliteStore(tmp_path / "history.sqlite")
    ch = ClickHouseStore.on_chdb(chdb_dir, "retention")
    try:
        mutations = check_retention(ch, sqlite)
        assert mutations and all("MATERIALIZE TTL" in m for m in mutations), mutations
    finally:
        sqlite.close()
        ch.close()


def test_the_exports_read_the_same_from_either_store(stores: tuple[SqliteStore, Any]) -> None:
    """The Perfetto trace (every span, counter, mark of every rank, and a step window of one
    rank) and the trackers' points and params: the queries the exports send, on the modern DDL."""
    from stepwatch.exports.perfetto import TraceSelection, iter_trace_events
    from stepwatch.exports.tracker_data import tracker_params, tracker_points

    sqlite, ch = stores
    (session,) = sqlite.sessions()
    sid = session["session_id"]
    for selection in (TraceSelection(sid), TraceSelection(sid, ranks=frozenset({1}))):
        events = list(iter_trace_events(sqlite, selection))
        assert list(iter_trace_events(ch, selection)) == events and len(events) > 100
    assert tracker_points(ch, sid) == tracker_points(sqlite, sid) != []
    assert tracker_params(ch, sid, {}) == tracker_params(sqlite, sid, {})


def test_the_dashboards_views_read_the_same_from_either_store(stores: tuple[SqliteStore, Any]) -> None:
    """The run page (its rank extents, step and phase buckets, memory chart) and its live
    updates: the store's own reads of them (store.clickhouse_views) on the modern DDL."""
    from stepwatch.views import run_page as views

    sqlite, ch = stores
    (session,) = sqlite.sessions()
    sid = session["session_id"]
    page = views.run_page(sqlite, sid, None)
    assert views.run_page(ch, sid, None) == page and len(page["step_time"]["series"]) == 2
    extents = views.last_steps(sqlite, sid)
    first, last = min(a for a, _ in extents.values()), max(b for _, b in extents.values())
    n = (last - first) // 7 + 1
    assert views._step_buckets(ch, sid, [0, 1], first, 7, n) == views._step_buckets(sqlite, sid, [0, 1], first, 7, n)
    assert views._phase_buckets(ch, sid, [0, 1], first, 7, n) == views._phase_buckets(sqlite, sid, [0, 1], first, 7, n)
