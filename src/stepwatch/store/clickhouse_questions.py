"""``stepwatch query``'s named questions (``--sessions``, ``--ooms``, ``--alerts``,
``--slowest-steps N``, ``--rank-skew``) on a ClickHouse store, giving the rows SQLite gives.

Each question is split where the rows are many and the answer few: the server filters or
reduces (the error events, the alerts, the N slowest steps, per-session counts, per-step and
per-rank sums for the skew), and the presentation (ISO times by SQLite's ``strftime``, its
``ROUND``, ``json_extract``, averages as SQLite takes them) runs in an in-memory SQLite over
what came back, with the question's own SQL where the rows came back whole. So the text,
rounding and order of every cell are SQLite's by construction, and the server moves a few rows
per session or rank, not the steps table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from ..errors import StoreError
from .base import COLUMNS
from .clickhouse_ddl import time_ns

__all__ = ["ask_named"]

_ISO = "strftime('%Y-%m-%dT%H:%M:%fZ', {0} / 1e9, 'unixepoch')"


def _avg(total: str, count: str) -> str:
    """SQLite's AVG of integers from their sum and count: the sum as a double over the count."""
    return f"(CASE WHEN {count} = 0 THEN NULL ELSE CAST({total} AS REAL) / {count} END)"


_SESSIONS_FINISH = (
    f"SELECT s.session_id, s.status, {_ISO.format('s.started_at_ns')} AS started, "
    "ROUND((s.ended_at_ns - s.started_at_ns) / 1e9, 3) AS duration_s, s.world_size, s.host, s.source, "
    "COALESCE((SELECT n FROM step_counts t WHERE t.session_id = s.session_id), 0) AS step_rows, "
    "COALESCE((SELECT n FROM alert_counts a WHERE a.session_id = s.session_id), 0) AS alerts "
    "FROM sessions s ORDER BY s.started_at_ns DESC, s.session_id")
_SKEW_FINISH = (
    "SELECT a.session_id, a.rank, a.n AS steps, "
    f"ROUND({_avg('a.sum_step', 'a.cnt_step')} / 1e6, 3) AS mean_step_ms, "
    f"ROUND(100.0 * ({_avg('a.sum_step', 'a.cnt_step')} - {_avg('m.sum_step', 'm.cnt_step')}) / "
    f"{_avg('m.sum_step', 'm.cnt_step')}, 1) AS vs_mean_pct, "
    f"ROUND({_avg('a.sum_wait', 'a.cnt_wait')} / 1e6, 3) AS mean_wait_ms, "
    f"ROUND({_avg('a.sum_lag', 'a.cnt_lag')} / 1e6, 3) AS mean_lag_ms, "
    "CASE WHEN a.slow_known = 0 THEN NULL ELSE a.slow_sum END AS slowest_in_steps "
    "FROM skew a JOIN session_means m ON m.session_id = a.session_id ORDER BY a.session_id, a.rank")


def ask_named(store: Any, name: str, question: tuple[str, tuple[Any, ...]], session_id: str | None = None,
              n: int | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(columns, rows) of the named question ``name`` over ``store`` (a ClickHouseStore);
    ``question``: its SQLite SQL and parameters (``user_query.named_question``)."""
    where, params = ("session_id = ?", (session_id,)) if session_id is not None else ("1", ())
    memory = sqlite3.connect(":memory:")
    try:
        if name == "sessions":
            _load(memory, "sessions", [c for c, _ in COLUMNS["sessions"]],
                  store.query_tuples(f"SELECT * FROM sessions WHERE {where}", params))
            for table, source in (("step_counts", "steps_rows FINAL"), ("alert_counts", "alerts_rows FINAL")):
                _load(memory, table, ["session_id", "n"], store.query_tuples(
                    f"SELECT session_id, count() FROM {source} WHERE {where} GROUP BY session_id", params))
            cursor = memory.execute(_SESSIONS_FINISH)
        elif name == "rank-skew":
            _rank_skew(store, memory, where, params)
            cursor = memory.execute(_SKEW_FINISH)
        else:
            table, server_sql = {
                "ooms": ("telemetry", f"SELECT * FROM telemetry WHERE event_type = 'error' AND {where}"),
                "alerts": ("alerts", f"SELECT * FROM alerts WHERE {where}"),
                # the question's order (NULLs last, as SQLite sorts them descending), then its LIMIT
                "slowest-steps": ("steps", f"SELECT * FROM steps WHERE {where} ORDER BY step_ns DESC NULLS LAST, "
                                           f"session_id, rank, step" + (f" LIMIT {int(n)}" if n is not None else "")),
            }.get(name, (None, None))
            if table is None:
                raise StoreError(f"no named question {name!r}")
            _load(memory, table, [c for c, _ in COLUMNS[table]], store.query_tuples(server_sql, params))
            cursor = memory.execute(*question)
        return [d[0] for d in cursor.description or ()], cursor.fetchall()
    except sqlite3.Error as exc:
        raise StoreError(f"query: {name}: {exc}") from None
    finally:
        memory.close()


def _load(memory: sqlite3.Connection, table: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
    memory.execute(f"CREATE TABLE {table} ({', '.join(columns)})")
    memory.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in columns)})", rows)


def _rank_skew(store: Any, memory: sqlite3.Connection, where: str, params: tuple[Any, ...]) -> None:
    """The skew's sums and counts per (session, rank) and per session, reduced on the server
    (18.16: no WITH subqueries, joins by USING): each step row joined to its step's slowest
    time, first end and rank count, as the SQLite question's CTEs do."""
    end = time_ns("end_ns", store.features)
    steps = (f"SELECT session_id, rank, step, step_ns, {end} AS end_ns, wait_ns FROM steps_rows FINAL "
             f"WHERE step >= 0 AND {where}")
    slowest_here = "if(ranks > 1, step_ns = slowest, 0)"  # SQLite's `ranks > 1 AND step_ns = slowest`
    rows = store.query_tuples(
        f"SELECT toString(session_id), rank, count(), sum(step_ns), count(step_ns), sum(wait_ns), count(wait_ns), "
        f"sum(end_ns - first_end), count(end_ns - first_end), sum({slowest_here}), count({slowest_here}) "
        f"FROM ({steps}) AS s ANY LEFT JOIN (SELECT session_id, step, max(step_ns) AS slowest, min(end_ns) AS first_end, "
        f"count() AS ranks FROM ({steps}) GROUP BY session_id, step) AS p USING (session_id, step) "
        f"GROUP BY session_id, rank", (*params, *params))
    _load(memory, "skew", ["session_id", "rank", "n", "sum_step", "cnt_step", "sum_wait", "cnt_wait", "sum_lag",
                           "cnt_lag", "slow_sum", "slow_known"], rows)
    _load(memory, "session_means", ["session_id", "sum_step", "cnt_step"], store.query_tuples(
        f"SELECT toString(session_id), sum(step_ns), count(step_ns) FROM ({steps}) GROUP BY session_id", params))
