"""What every history backend offers: typed row tables, batched appends, the queries the views
and the summary need, retention. Rows are plain dicts whose keys are the columns below, so the
same rows go to SQLite or ClickHouse unchanged.

The interface knows no backend: ``store/open.py`` picks one from a path or URL, so a backend can
import this module without this module importing it back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, Self

from ..errors import StoreError
from ..phases import PHASES, RESIDUAL, STEP_COLUMNS
from ..schema.tables import TABLES as HISTORY_TABLES
from ..schema.tables import column_types

__all__ = ["COLUMNS", "QUANTILES", "TABLES", "HistoryStore", "SqlReads", "StepAggregate", "quantile_positions"]

# table -> (column, SQL type); `json` columns hold encoded JSON text. Declared once, with where
# each column comes from, in ``schema.tables``.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {table: column_types(table) for table in HISTORY_TABLES}
TABLES = tuple(COLUMNS)


# the step-time quantiles of the summary (median, p90, p99)
QUANTILES = (0.5, 0.9, 0.99)
# the phases outside the residual (wait_ns is the step less the others, its own fetch included)
_OUTSIDE_RESIDUAL = tuple(p.column for p in PHASES if not p.in_residual)


def quantile_positions(n: int, q: float) -> tuple[int, int]:
    """The 0-based positions in ``n`` sorted values whose interpolation is the ``q`` quantile
    (numpy's default, linear between closest ranks): ``low`` and ``min(low + 1, n - 1)``."""
    low = int((n - 1) * q)
    return low, min(low + 1, n - 1)


class StepAggregate(NamedTuple):
    """What the summary's step statistics need of a set of step rows, and no row: computed from
    the rows here (``from_rows``, the SQLite store) or on a server that can (the ClickHouse
    store's ``step_aggregates``), the same numbers either way. Every sum is of integers, exact."""

    rows: int  # step rows, with or without a step time
    n: int  # rows with a step time
    picks: tuple[tuple[int, int], ...]  # per QUANTILES: the sorted step times at quantile_positions
    max_ns: int | None
    total_ns: int  # sum of the step times
    phase_ns: tuple[int, ...]  # per STEP_COLUMNS: the sum (the residual: of max(0, wait - outside phases))
    first_start_ns: int | None
    last_end_ns: int | None

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> StepAggregate:
        times = sorted(r["step_ns"] for r in rows if r["step_ns"] is not None)
        n = len(times)
        picks = tuple((times[lo], times[hi]) for lo, hi in (quantile_positions(n, q) for q in QUANTILES)) if n else ()
        phases = []
        for column in STEP_COLUMNS:
            if column == RESIDUAL.column:
                phases.append(sum(max(0, (r.get(column) or 0) - sum((r.get(c) or 0) for c in _OUTSIDE_RESIDUAL))
                                  for r in rows))
            else:
                phases.append(sum((r.get(column) or 0) for r in rows))
        starts = [r["start_ns"] for r in rows if r.get("start_ns") is not None]
        ends = [r["end_ns"] for r in rows if r.get("end_ns") is not None]
        return cls(len(rows), n, picks, times[-1] if times else None, sum(times), tuple(phases),
                   min(starts) if starts else None, max(ends) if ends else None)


class HistoryStore(Protocol):
    """The one writer appends; any number of read-only readers query."""

    def append(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int: ...

    def append_many(self, batches: Mapping[str, list[Mapping[str, Any]]]) -> int:
        """All tables of one tick in one transaction."""

    def append_tuples(self, batches: Mapping[str, list[tuple[Any, ...]]],
                      batch_ids: Iterable[tuple[str, int]] = ()) -> int:
        """Like ``append_many``, for rows already as tuples in COLUMNS order with their JSON
        columns encoded (``rows.row_tuples``): what the aggregator's writer hands over. Records
        the (batch id, seen at ns) of the HTTP batches they came in, in the same transaction."""

    def upsert_session(self, row: Mapping[str, Any]) -> None: ...

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]: ...

    def iterate(self, sql: str, params: Iterable[Any] = (), size: int = 2048) -> Iterator[tuple[Any, ...]]:
        """The rows of ``sql`` as tuples, streamed from one cursor (bounded memory)."""

    def count(self, table: str, session_id: str | None = None) -> int: ...

    def sessions(self) -> list[dict[str, Any]]: ...

    def step_rows(self, session_id: str) -> list[dict[str, Any]]: ...

    def step_tuples(self, session_id: str, columns: Sequence[str]) -> list[tuple[Any, ...]]: ...

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]: ...

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]: ...

    def step_aggregates(self, session_id: str) -> tuple[StepAggregate, dict[int, StepAggregate]]:
        """The summary's step statistics' inputs (SqlReads: from the rows; a server may reduce)."""

    def apply_retention(self, window_ns: int, now_ns: int | None = None) -> int: ...

    def seen_batches(self, since_ns: int) -> dict[str, int]:
        """HTTP batch ids recorded at or after ``since_ns`` (the dedupe window), with when."""

    def forget_batches(self, before_ns: int) -> int: ...

    def close(self) -> None: ...


class SqlReads:
    """What every SQL store shares: the reads it answers with the same SQL over the same views,
    its clock and its context manager; each store brings its own ``query`` and ``close``."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    @staticmethod
    def now_ns() -> int:
        """The store's clock for retention: wall-clock nanoseconds, as the rows' times are."""
        return time.time_ns()

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        raise NotImplementedError

    def count(self, table: str, session_id: str | None = None) -> int:
        if table not in COLUMNS:
            raise StoreError(f"unknown table {table!r}")
        where, params = ("WHERE session_id = ?", (session_id,)) if session_id else ("", ())
        return int(self.query(f"SELECT COUNT(*) AS n FROM {table} {where}", params)[0]["n"])

    def sessions(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM sessions ORDER BY started_at_ns DESC")

    def step_rows(self, session_id: str) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM steps WHERE session_id = ? ORDER BY rank, step", (session_id,))

    def step_aggregates(self, session_id: str) -> tuple[StepAggregate, dict[int, StepAggregate]]:
        """The session's step statistics' inputs, of all its steps and of each rank's: here from
        its rows (a store that can reduce on its server answers it there)."""
        rows = self.step_rows(session_id)
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            by_rank.setdefault(row["rank"], []).append(row)
        return StepAggregate.from_rows(rows), {rank: StepAggregate.from_rows(r) for rank, r in sorted(by_rank.items())}

    def step_tuples(self, session_id: str, columns: Sequence[str]) -> list[tuple[Any, ...]]:
        """Every step row of ``session_id`` as a tuple of ``columns``, in no set order: the
        summary's one read of a session, which it orders itself (a store reads fastest in the
        order it keeps them)."""
        return self.query_tuples(f"SELECT {', '.join(columns)} FROM steps WHERE session_id = ?", (session_id,))

    def query_tuples(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def memory_peaks(self, session_id: str) -> list[dict[str, Any]]:
        return self.query(
            "SELECT rank, collector, device_id, MAX(allocated) AS peak_allocated, MAX(reserved) AS peak_reserved, "
            "MAX(total) AS total FROM telemetry WHERE session_id = ? AND event_type = 'sample' "
            "GROUP BY rank, collector, device_id ORDER BY rank, device_id",
            (session_id,),
        )
