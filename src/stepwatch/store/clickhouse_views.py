"""The dashboard's reads (``views.run_page``) on a ClickHouse store, giving what the SQLite SQL
gives: the run page's charts, the rank extents, the memory chart's buckets.

The SQLite path reads them with SQL only SQLite speaks: a recursive CTE seeking each rank's
first and last step down ``steps_unique``, a TEMP table of buckets joined to the steps by index
range, integer ``/``, a bare column beside ``MIN``/``MAX`` (SQLite gives it the row of the one
minimum). Here each is one ``GROUP BY`` over the session's key range (the tables are ordered by
session, rank, step or time), and the server reduces: a few thousand bucket rows cross the
connection, never the steps.

Where SQLite chooses among ties by its scan order, these choose the same way explicitly: a
bucket's lowest and highest step time are ``min``/``max`` of the tuple (time, step), so the
lowest time's lowest step and the highest time's highest step (SQLite packs the step under the
time: the same order); a memory bucket's sample is the earliest of its lowest or highest value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..phases import STEP_COLUMNS
from .clickhouse_ddl import literal

__all__ = ["MEMORY_VALUE", "memory_buckets", "phase_buckets", "rank_step_extents", "step_buckets"]

# the larger of allocated and used bytes (SQLite: the scalar MAX of two values)
MEMORY_VALUE = "greatest(coalesce(allocated, 0), coalesce(used, 0))"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(literal(int(r)) for r in ranks)


def rank_step_extents(store: Any, session_id: str) -> dict[int, tuple[int, int]]:
    """rank -> (its first step, its last step), one pass over the session's key range."""
    rows = store.query_tuples("SELECT rank, min(step), max(step) FROM steps WHERE session_id = ? AND rank IS NOT NULL "
                              "GROUP BY rank ORDER BY rank", (session_id,))
    return {int(rank): (int(first), int(last)) for rank, first, last in rows if last is not None}


def _bucketed(session_id: str, ranks: Sequence[int], first: int, width: int, n_buckets: int) -> tuple[str, str]:
    """(the bucket expression, the WHERE clause) of the steps of ``ranks`` in ``n_buckets``
    buckets of ``width`` steps from ``first`` with a step time."""
    last = first + n_buckets * width - 1
    where = (f"session_id = {literal(session_id)} AND rank IN ({_ranks(ranks)}) "
             f"AND step BETWEEN {literal(first)} AND {literal(last)} AND step_ns IS NOT NULL")
    return f"intDiv(step - {literal(first)}, {literal(width)})", where


def step_buckets(store: Any, session_id: str, ranks: Sequence[int], first: int, width: int,
                 n_buckets: int) -> list[tuple[int, int, tuple[int, int], tuple[int, int]]]:
    """Per (rank, bucket): (rank, bucket, (step, time) of its lowest step time, (step, time) of its
    highest), the ties broken as the SQLite path breaks them (module docstring)."""
    if not ranks:
        return []
    bucket, where = _bucketed(session_id, ranks, first, width, n_buckets)
    rows = store.query_tuples(f"SELECT rank, {bucket} AS b, min((step_ns, step)), max((step_ns, step)) FROM steps "
                              f"WHERE {where} GROUP BY rank, b ORDER BY rank, b")
    return [(int(rank), int(b), (int(lo[1]), int(lo[0])), (int(hi[1]), int(hi[0]))) for rank, b, lo, hi in rows]


def phase_buckets(store: Any, session_id: str, ranks: Sequence[int], first: int, width: int,
                  n_buckets: int) -> list[tuple[Any, ...]]:
    """Per (rank, bucket): (rank, bucket, the step times' sum, each STEP_COLUMNS column's sum)."""
    if not ranks:
        return []
    bucket, where = _bucketed(session_id, ranks, first, width, n_buckets)
    sums = ", ".join(f"sum({column})" for column in STEP_COLUMNS)
    return store.query_tuples(f"SELECT rank, {bucket} AS b, sum(step_ns), {sums} FROM steps WHERE {where} "
                              f"GROUP BY rank, b ORDER BY rank, b")


def memory_buckets(store: Any, session_id: str, since_ns: int | None, first: int, width: int,
                   pick: str) -> list[tuple[Any, ...]]:
    """Per (rank, device, collector, bucket of ``width`` ns from ``first``) of the session's
    memory samples (after ``since_ns``): (rank, device, collector, bucket, the time of the
    earliest sample of its lowest (``pick`` MIN) or highest (MAX) value, that value)."""
    after = f"AND timestamp_ns > {literal(since_ns)}" if since_ns is not None else ""
    if pick == "MIN":
        chosen = f"argMin(timestamp_ns, ({MEMORY_VALUE}, timestamp_ns)), min({MEMORY_VALUE})"
    else:
        chosen = f"argMax(timestamp_ns, ({MEMORY_VALUE}, -timestamp_ns)), max({MEMORY_VALUE})"
    return store.query_tuples(
        f"SELECT rank, device_id, collector, intDiv(timestamp_ns - {literal(first)}, {literal(width)}) AS b, {chosen} "
        f"FROM telemetry WHERE session_id = {literal(session_id)} AND event_type = 'sample' {after} "
        f"GROUP BY rank, device_id, collector, b")
