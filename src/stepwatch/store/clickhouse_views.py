"""The dashboard's reads (``views.run_page``) on a ClickHouse store, giving what the SQLite SQL
gives: the run page's charts, the rank extents, the memory chart's buckets.

The SQLite path reads them with SQL only SQLite speaks: a recursive CTE seeking each rank's
first and last step down ``steps_unique``, a TEMP table of buckets joined to the steps by index
range, integer ``/``, a bare column beside ``MIN``/``MAX`` (SQLite gives it the row of the one
minimum). Here each is one ``GROUP BY`` over the session's key range (the tables are ordered by
session, rank, step or time), and the server reduces: a few thousand bucket rows cross the
connection, never the steps. The step reads go to ``steps_rows FINAL`` (as ``step_aggregates``
does), not the ``steps`` view: the view reads its key columns through ``toNullable``, which keeps
the server from using the sorting key for ``session_id = ...`` (on 64 ranks x 20,000 steps a bucket
read took 0.65 s through the view, 0.23 s on the table); the columns read (rank, step, the step
time and phases: integers on every server version) are the view's values.

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
    rows = store.query_tuples("SELECT rank, min(step), max(step) FROM steps_rows FINAL WHERE session_id = ? "
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
    # the tuples' elements as columns: a client may hand a tuple over as a dict (chdb's Arrow structs)
    picks = ", ".join(f"tupleElement({f}((step_ns, step)), {i})" for f in ("min", "max") for i in (2, 1))
    rows = store.query_tuples(f"SELECT rank, {bucket} AS b, {picks} FROM steps_rows FINAL "
                              f"WHERE {where} GROUP BY rank, b ORDER BY rank, b")
    return [(int(rank), int(b), (int(lo_step), int(lo_ns)), (int(hi_step), int(hi_ns)))
            for rank, b, lo_step, lo_ns, hi_step, hi_ns in rows]


def phase_buckets(store: Any, session_id: str, ranks: Sequence[int], first: int, width: int,
                  n_buckets: int) -> list[tuple[Any, ...]]:
    """Per (rank, bucket): (rank, bucket, the step times' sum, each STEP_COLUMNS column's sum)."""
    if not ranks:
        return []
    bucket, where = _bucketed(session_id, ranks, first, width, n_buckets)
    sums = ", ".join(f"sum({column})" for column in STEP_COLUMNS)
    return store.query_tuples(f"SELECT rank, {bucket} AS b, sum(step_ns), {sums} FROM steps_rows FINAL WHERE {where} "
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
