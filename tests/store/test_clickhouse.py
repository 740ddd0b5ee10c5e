"""The ClickHouse store against Debian's real clickhouse-server (18.16): one real two-rank run
imported into it and into a history.sqlite, then the same questions asked of both. No mock or
stub of ClickHouse anywhere: without the server these tests skip (fail under CI)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.errors import StoreError
from stepwatch.store import open_store
from stepwatch.store.base import COLUMNS
from stepwatch.store.importers import import_path
from stepwatch.store.sqlite import SqliteStore
from tests.support import examples, run_stepwatch
from tests.support.clickhouse import mutations_done
from tests.support.store_compare import SELECTS, T0, both_stores, check_retention, named_answers
from tests.support.store_rows import mark, span, step
from tests.support.trace_run import STEPS_PER_RANK, trace_run

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session-shared two-rank run (read only)."""
    return trace_run(tmp_path_factory)


@pytest.fixture(scope="module")
def stores(clickhouse_server: Any, run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run imported into a fresh ClickHouse database (twice: idempotent) and into a new
    history.sqlite; the written counts of each import."""
    url = clickhouse_server.database_url("imported")
    sqlite_path = tmp_path_factory.mktemp("ch-sqlite") / "history.sqlite"
    with SqliteStore(sqlite_path) as sqlite:
        first_sqlite = import_path(run_dir, sqlite)
    ch = open_store(url)
    try:
        first = import_path(run_dir, ch)
        second = import_path(run_dir, ch)
    finally:
        ch.close()
    return {"url": url, "sqlite": sqlite_path, "first": first, "second": second, "first_sqlite": first_sqlite}


def test_import_stores_every_row_once(stores: dict[str, Any]) -> None:
    assert stores["first"] == stores["first_sqlite"]
    assert stores["first"]["steps"] == 2 * STEPS_PER_RANK
    for sqlite, ch in both_stores(stores["sqlite"], stores["url"]):
        for table in COLUMNS:  # the second import stored nothing twice
            assert ch.count(table) == sqlite.count(table), table
        assert ch.count("steps") == 2 * STEPS_PER_RANK


@pytest.mark.parametrize("sql", SELECTS)
def test_the_same_select_gives_the_same_rows(stores: dict[str, Any], sql: str) -> None:
    for sqlite, ch in both_stores(stores["sqlite"], stores["url"]):
        expected = sqlite.query(sql)
        assert expected or "no-such" in sql  # the run has rows for every other question
        assert ch.query(sql) == expected


def test_summary_and_explain_are_identical_to_sqlite(stores: dict[str, Any], tmp_path: Path) -> None:
    outputs = {}
    for name, target in (("sqlite", str(stores["sqlite"])), ("clickhouse", stores["url"])):
        summary = run_stepwatch("summary", target, "--json", cwd=tmp_path)
        explain = run_stepwatch("explain", target, "--json", cwd=tmp_path)
        assert summary.returncode == 0 and explain.returncode == 0, summary.stderr + explain.stderr
        outputs[name] = (json.loads(summary.stdout), json.loads(explain.stdout))
    (summary_sqlite, explain_sqlite), (summary_ch, explain_ch) = outputs["sqlite"], outputs["clickhouse"]
    assert summary_ch == summary_sqlite
    assert summary_ch["overall"]["steps"] == 2 * STEPS_PER_RANK
    assert explain_ch.pop("source") == stores["url"]
    explain_sqlite.pop("source")
    assert explain_ch == explain_sqlite
    assert explain_ch["diagnosis"]["primary"]


def test_query_is_read_only_and_answers_like_sqlite(stores: dict[str, Any], tmp_path: Path) -> None:
    sql = "SELECT rank, COUNT(*) AS steps, AVG(step_ns) AS mean_ns FROM steps GROUP BY rank ORDER BY rank"
    ch = run_stepwatch("query", stores["url"], sql, "--format", "json", cwd=tmp_path)
    sqlite = run_stepwatch("query", str(stores["sqlite"]), sql, "--format", "json", cwd=tmp_path)
    assert ch.returncode == 0, ch.stderr
    assert json.loads(ch.stdout) == json.loads(sqlite.stdout)
    for write in ("INSERT INTO steps_rows (session_id, rank, step) VALUES ('x', 0, 1)",
                  "DROP TABLE steps_rows", "CREATE TABLE evil (x Int64) ENGINE = Memory",
                  "ALTER TABLE steps_rows DELETE WHERE 1"):
        refused = run_stepwatch("query", stores["url"], write, cwd=tmp_path)
        assert refused.returncode == 2
        assert "read-only" in refused.stderr or "readonly" in refused.stderr, refused.stderr
    for sqlite_store, ch_store in both_stores(stores["sqlite"], stores["url"]):
        assert ch_store.count("steps") == sqlite_store.count("steps") == 2 * STEPS_PER_RANK


def test_a_named_database_is_made_on_first_use_and_read_only_never_makes_one(clickhouse_server: Any) -> None:
    url = clickhouse_server.database_url("fresh")
    with pytest.raises(StoreError, match="no database"):
        open_store(url, read_only=True)
    store = open_store(url)
    try:
        assert store.sessions() == []
        store.upsert_session({"session_id": "s1", "status": "running", "started_at_ns": 5, "world_size": 2})
        store.upsert_session({"session_id": "s1", "status": "completed", "started_at_ns": 3})
        store.upsert_session({"session_id": "s1", "status": "running", "host": "h"})  # never back to running
        (row,) = store.sessions()
        assert (row["status"], row["started_at_ns"], row["world_size"], row["host"]) == ("completed", 3, 2, "h")
    finally:
        store.close()


def test_bad_urls_and_unreachable_servers_are_clear_errors(tmp_path: Path) -> None:
    bad_port = run_stepwatch("query", "clickhouse://default@127.0.0.1:99999/db", "SELECT 1", cwd=tmp_path)
    assert bad_port.returncode == 2 and "port" in bad_port.stderr and "99999" in bad_port.stderr
    bad_db = run_stepwatch("summary", "clickhouse://default@127.0.0.1/my-db", cwd=tmp_path)
    assert bad_db.returncode == 2 and "database" in bad_db.stderr
    other = run_stepwatch("import", str(tmp_path), "--into", "postgres://h/db", cwd=tmp_path)
    assert other.returncode == 2 and "scheme" in other.stderr
    with pytest.raises(StoreError, match="cannot open history store"):
        from tests.support import free_port

        open_store(f"clickhouse://default@127.0.0.1:{free_port()}/db")


@settings(max_examples=examples(60))
@given(values=st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=30),
                                 st.floats(allow_nan=False, allow_infinity=False)), min_size=1, max_size=4))
def test_bound_parameters_reach_the_server_as_the_values_given(clickhouse_server: Any, values: list[Any]) -> None:
    """``?`` placeholders are bound as literals (18.16 has no server-side parameters): whatever
    the text (quotes, backslashes, ``?`` inside it), the server reads back the value given."""
    store = open_store(f"clickhouse://default@127.0.0.1:{clickhouse_server.tcp_port}/default", read_only=True)
    try:
        sql = "SELECT " + ", ".join(f"? AS c{i}" for i in range(len(values))) + " -- a ? in a comment"
        (row,) = store.query_tuples(sql, values)
        assert list(row) == values
    finally:
        store.close()


def test_retention_and_batch_ids_as_on_sqlite(clickhouse_server: Any, tmp_path: Path) -> None:
    sqlite = SqliteStore(tmp_path / "history.sqlite")
    ch = open_store(clickhouse_server.database_url("retention"))
    try:
        mutations = check_retention(ch, sqlite)
        assert mutations and all("DELETE WHERE" in m for m in mutations)  # 18.16 has no TTL: mutations
        ids = [("batch-a", 1_000), ("batch-b", 2_000)]
        for store in (sqlite, ch):
            store.append_tuples({}, ids)
            store.append_tuples({}, ids[:1])  # a retried batch id is kept once
        assert ch.seen_batches(0) == sqlite.seen_batches(0) == dict(ids)
        assert ch.seen_batches(1_500) == {"batch-b": 2_000}
        assert ch.forget_batches(1_500) == sqlite.forget_batches(1_500) == 1
        mutations_done(ch)
        assert ch.seen_batches(0) == sqlite.seen_batches(0) == {"batch-b": 2_000}
    finally:
        sqlite.close()
        ch.close()


@settings(max_examples=15)
@given(data=st.data())
def test_any_batches_with_repeats_read_back_as_sqlite_reads_them(clickhouse_server: Any, data: Any) -> None:
    """Batches drawn with repeated ids, split anyhow and written twice: ClickHouse's views read
    exactly the rows SQLite's unique indexes kept."""
    import uuid

    sid = f"s-{uuid.uuid4().hex[:8]}"
    n = data.draw(st.integers(1, 12))
    rows = {"spans": [span(sid, i % 2, f"sp{i % 5}", 10 * (i % 5)) for i in range(n)],
            "marks": [mark(sid, 0, f"m{i % 4}", 7 * (i % 4), value=float(i % 4)) for i in range(n)],
            "steps": [step(sid, i % 3, i % 4, 100 * (i % 4) + i % 3) for i in range(n)]}
    cut = data.draw(st.integers(0, n))
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = SqliteStore(Path(tmp) / "history.sqlite")
        ch = open_store(f"clickhouse://default@127.0.0.1:{clickhouse_server.tcp_port}/repeats")
        try:
            for store in (sqlite, ch):
                for part in ({t: r[:cut] for t, r in rows.items()}, {t: r[cut:] for t, r in rows.items()}, rows):
                    store.append_many(part)
            for sql in ("SELECT * FROM spans WHERE session_id = ? ORDER BY rank, span_id",
                        "SELECT * FROM marks WHERE session_id = ? ORDER BY mark_id",
                        "SELECT * FROM steps WHERE session_id = ? ORDER BY rank, step"):
                assert ch.query(sql, (sid,)) == sqlite.query(sql, (sid,)), sql
        finally:
            sqlite.close()
            ch.close()


def test_compare_a_clickhouse_session_with_the_same_run_on_sqlite(stores: dict[str, Any], tmp_path: Path) -> None:
    compared = run_stepwatch("compare", stores["url"], str(stores["sqlite"]), "--json", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    verdict = json.loads(compared.stdout)["verdict"]
    assert verdict["verdict"] == "EQUIVALENT", verdict
    same = run_stepwatch("compare", stores["url"], stores["url"], cwd=tmp_path)
    assert same.returncode == 2 and "--session-a" in same.stderr


def test_tables_made_before_a_column_was_declared_are_moved_forward(clickhouse_server: Any) -> None:
    """A database made by an older stepwatch (here: one whose steps and sessions lack a column)
    gets the column, NULL in its old rows, and its views again, on the next open for writing."""
    url = clickhouse_server.database_url("old")
    store = open_store(url)
    try:
        store.append_many({"steps": [step("s", 0, 1, 10)]})
        store.upsert_session({"session_id": "s", "status": "running"})
        last_step, last_session = COLUMNS["steps"][-1][0], COLUMNS["sessions"][-1][0]
        store.query_tuples(f"ALTER TABLE steps_rows DROP COLUMN {last_step}")
        store.query_tuples(f"ALTER TABLE sessions_rows DROP COLUMN {last_session}")
    finally:
        store.close()
    store = open_store(url)
    try:
        (row,) = store.query("SELECT * FROM steps")
        assert list(row) == [name for name, _ in COLUMNS["steps"]] and row[last_step] is None
        (session,) = store.sessions()
        assert session["status"] == "running" and session[last_session] is None
        store.append_many({"steps": [step("s", 0, 2, 20)]})
        assert store.count("steps") == 2
    finally:
        store.close()


# -- the named questions and the server-side reductions -------------------------------------

def test_named_questions_give_sqlite_rows(stores: dict[str, Any], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from stepwatch.ui.cli import cli

    for sqlite, ch in both_stores(stores["sqlite"], stores["url"]):
        (session,) = sqlite.sessions()
        for sid in (None, session["session_id"]):
            for name, expected, got in named_answers(stores["sqlite"], ch, sid):
                assert got == expected, name
                assert expected[1] or name in ("ooms", "alerts"), name  # a healthy run: no OOM, no alert
    runner = CliRunner()
    answers = [runner.invoke(cli, ["query", target, "--rank-skew", "--format", "json"])
               for target in (stores["url"], str(stores["sqlite"]))]
    assert answers[0].exit_code == 0, answers[0].output
    assert json.loads(answers[0].output) == json.loads(answers[1].output) != []


_MAYBE_NS = st.one_of(st.none(), st.integers(0, 10**10))


@settings(max_examples=20)
@given(data=st.data())
def test_server_side_reductions_equal_the_sqlite_path(clickhouse_server: Any, data: Any) -> None:
    """Random step tables (NULL times and phases, ranks with few steps, ties): the summary's step
    statistics reduced on the server (quantile picks, exact sums), the verdict window and the
    named questions that reduce steps are what the SQLite store gives on the same rows."""
    import uuid

    from stepwatch.analysis.summary import _per_rank, step_aggregate, step_stats
    from stepwatch.analysis.verdicts.inputs import BARRIER_WAIT_MARK, load_verdict_inputs, session_steps
    from stepwatch.phases import STEP_COLUMNS

    sid = f"s-{uuid.uuid4().hex[:8]}"
    rows = []
    for rank in range(data.draw(st.integers(1, 3))):
        for n in range(data.draw(st.integers(0, 12))):
            start = T0 + n * 1_000_000 + data.draw(st.integers(0, 999))
            row = {"session_id": sid, "rank": rank, "step": n, "start_ns": start,
                   "end_ns": start + data.draw(st.integers(0, 10**6)), "step_ns": data.draw(_MAYBE_NS)}
            row.update({c: data.draw(_MAYBE_NS) for c in STEP_COLUMNS})
            rows.append(row)
    # the waits in dist.barrier() between steps, summed per rank over the window's span
    waits = [{**mark(sid, row["rank"], f"w{i}", row["end_ns"] + 1, data.draw(st.floats(0, 50))),
              "name": BARRIER_WAIT_MARK} for i, row in enumerate(rows) if data.draw(st.booleans())]
    window = data.draw(st.one_of(st.none(), st.integers(1, 8)))
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = SqliteStore(Path(tmp) / "history.sqlite")
        ch = open_store(f"clickhouse://default@127.0.0.1:{clickhouse_server.tcp_port}/reductions")
        try:
            for store in (sqlite, ch):
                store.append_many({"steps": rows, "marks": waits})
            (overall, ranks), (ch_overall, ch_ranks) = sqlite.step_aggregates(sid), ch.step_aggregates(sid)
            assert (ch_overall, ch_ranks) == (overall, ranks)
            columns = session_steps(sqlite, sid)  # the summary's own path: one columnar read
            assert step_aggregate(columns) == ch_overall
            assert {rank: step_aggregate(rows) for rank, rows in _per_rank(columns).items()} == ch_ranks
            assert step_stats(ch_overall) == step_stats(overall)
            a, b = load_verdict_inputs(sqlite, sid, last_steps=window), load_verdict_inputs(ch, sid, last_steps=window)
            assert [dict(r) for r in a.steps] == [dict(r) for r in b.steps] and a[1:-1] == b[1:-1]
            waited, ch_waited = a.barrier_wait_ns or {}, b.barrier_wait_ns or {}
            span = a.steps.span() if len(a.steps) else None
            expected: dict[int, float] = {}
            window_ranks = {r["rank"] for r in a.steps}
            for wait in waits if span is not None else ():
                if span[0] <= wait["ts_ns"] <= span[1] and wait["rank"] in window_ranks:
                    expected[wait["rank"]] = expected.get(wait["rank"], 0.0) + wait["value_num"] * 1e6
            for got in (waited, ch_waited):
                assert got.keys() == expected.keys()
                assert all(math.isclose(got[r], expected[r], rel_tol=1e-9, abs_tol=1e-3) for r in got)
            sqlite.close()
            for name, expected, got in named_answers(Path(tmp) / "history.sqlite", ch, sid):
                if name in ("rank-skew", "slowest-steps"):
                    assert got == expected, name
        finally:
            sqlite.close()
            ch.close()


def test_export_perfetto_from_a_url_gives_the_sqlite_trace(stores: dict[str, Any], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from stepwatch.ui.cli import cli

    traces = []
    for name, target in (("ch", stores["url"]), ("sqlite", str(stores["sqlite"]))):
        result = CliRunner().invoke(cli, ["export", "perfetto", target, "-o", str(tmp_path / f"{name}.json")])
        assert result.exit_code == 0, result.output
        traces.append(json.loads((tmp_path / f"{name}.json").read_text()))
    (ch, sqlite) = traces
    assert ch["traceEvents"] == sqlite["traceEvents"] != []
    assert ch["otherData"]["session_id"] == sqlite["otherData"]["session_id"]


def _alert(sid: str, ts: int, kind: str = "STORE_DEGRADED") -> dict[str, Any]:
    return {"session_id": sid, "ts_ns": ts, "kind": kind, "severity": "warn", "ranks": [], "step": None,
            "message": f"{kind} at {ts}", "evidence": {"spill_path": "x"}}


def _verdict(sid: str, ts: int, step: int) -> dict[str, Any]:
    return {"session_id": sid, "ts_ns": ts, "step": step, "window_steps": 50, "name": "INPUT_BOUND",
            "severity": "warn", "score": 0.5, "ranks": [0], "message": "m", "next_step": "n", "evidence": {}}


def test_a_batch_written_again_after_a_failure_part_way_is_read_once(clickhouse_server: Any, tmp_path: Path) -> None:
    """What the aggregator's feed does after a write failed part way (server/store_feed.py): the
    tables before the failure are written, then the whole batch again, and again on a second
    retry. Every table, alerts and verdicts included, reads each row once: what SQLite reads
    after one write."""
    from stepwatch.store.rows import row_tuples

    sid = "replayed"
    rows = {"steps": [step(sid, r, n, 1_000 * n + r) for r in range(2) for n in range(3)],
            "marks": [mark(sid, 0, f"m{n}", 10 * n) for n in range(3)],
            "alerts": [_alert(sid, 5_000), _alert(sid, 6_000, "RANK_LOST")],
            "verdicts": [_verdict(sid, 7_000, 2)]}
    tuples = {table: row_tuples(table, table_rows) for table, table_rows in rows.items()}
    ch = open_store(clickhouse_server.database_url("replay"))
    sqlite = SqliteStore(tmp_path / "history.sqlite")
    try:
        sqlite.append_tuples(tuples, [("batch-1", 1_000)])
        ch.append_tuples({"steps": tuples["steps"], "marks": tuples["marks"]})  # the failure part way
        for _ in range(2):  # the replay, twice
            ch.append_tuples(tuples, [("batch-1", 1_000)])
            ch.upsert_session({"session_id": sid, "status": "completed", "started_at_ns": 1, "ended_at_ns": 9})
        sqlite.upsert_session({"session_id": sid, "status": "completed", "started_at_ns": 1, "ended_at_ns": 9})
        for table, order in (("steps", "rank, step"), ("marks", "mark_id"), ("alerts", "ts_ns"),
                             ("verdicts", "ts_ns"), ("sessions", "session_id")):
            sql = f"SELECT * FROM {table} ORDER BY {order}"
            assert ch.query(sql) == sqlite.query(sql), table
        assert ch.seen_batches(0) == {"batch-1": 1_000}
    finally:
        ch.close()
        sqlite.close()


def test_alerts_and_verdicts_made_as_merge_tree_are_moved_to_replacing_merge_tree(clickhouse_server: Any) -> None:
    """A database made before alerts and verdicts were unique: on the next open for writing
    their tables become ReplacingMergeTree, with their rows."""
    url = clickhouse_server.database_url("engines")
    store = open_store(url)
    try:
        for table in ("alerts", "verdicts"):
            columns = store.query_tuples(f"SELECT name, type FROM system.columns WHERE database = currentDatabase() "
                                         f"AND table = '{table}_rows'")
            store.query_tuples(f"DROP TABLE {table}")
            store.query_tuples(f"DROP TABLE {table}_rows")
            body = ", ".join(f"{name} {kind}" for name, kind in columns)
            store.query_tuples(f"CREATE TABLE {table}_rows ({body}) ENGINE = MergeTree() "
                               f"PARTITION BY toYYYYMMDD(toDateTime(intDiv(ts_ns, 1000000000))) ORDER BY (session_id, ts_ns)")
        store.append_many({"alerts": [_alert("old", 1_000)], "verdicts": [_verdict("old", 2_000, 1)]})
    finally:
        store.close()
    store = open_store(url)
    try:
        engines = dict(store.query_tuples("SELECT name, engine FROM system.tables WHERE database = currentDatabase() "
                                          "AND name IN ('alerts_rows', 'verdicts_rows')"))
        assert engines == {"alerts_rows": "ReplacingMergeTree", "verdicts_rows": "ReplacingMergeTree"}
        store.append_many({"alerts": [_alert("old", 1_000)], "verdicts": [_verdict("old", 2_000, 1)]})
        assert store.count("alerts") == 1 and store.count("verdicts") == 1
        assert store.query("SELECT message FROM alerts") == [{"message": "STORE_DEGRADED at 1000"}]
    finally:
        store.close()


def test_the_cluster_questions_of_the_scale_out_page_run_on_the_server(stores: dict[str, Any]) -> None:
    """Every SQL statement docs/scale-out.md shows a cluster's users runs, read-only, on 18.16."""
    from stepwatch.store.user_query import ask_url

    page = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    block = page.split("```sql\n", 1)[1].split("```", 1)[0]
    statements = [" ".join(line for line in chunk.splitlines() if not line.startswith("--"))
                  for chunk in block.split("\n\n")]
    assert len(statements) == 3
    named = [["session_id", "steps", "median_ms"], ["session_id", "name", "ranks", "message"], ["kind", "n"]]
    for sql, columns in zip(statements, named):
        with ask_url(stores["url"], sql) as answer:
            assert answer.columns == columns, sql
    with ask_url(stores["url"], statements[0].replace("1795478400000000000", "0")) as answer:
        rows = list(answer.rows)
    assert len(rows) == 1 and rows[0][1] == 2 * STEPS_PER_RANK  # the imported run, its every step
