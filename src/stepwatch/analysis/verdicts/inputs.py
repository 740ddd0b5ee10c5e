"""What ``diagnose`` takes, read from a history store: only the window's rows.

The live window is read every few seconds from a history that keeps growing, so nothing here
scans a session: each rank's last step comes from one seek down the steps' unique index
(session, rank, step), the ranks from a skip-scan of the same index, and the window's rows and
memory samples from range seeks per rank (``rank IN (...)`` with a step or time range). Reading
the last 100 steps costs the same on a history of 100 steps as on one of 20,000.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ...store.base import HistoryStore
from ...store.sqlite import SESSION_RANKS
from .model import Diagnosis
from .policy import DEFAULT_POLICY, VerdictPolicy
from .step_columns import COLUMNS, StepColumns

__all__ = ["VerdictInputs", "diagnose_store", "load_verdict_inputs", "session_steps"]

# capture/torch_patches.py's: the ms a rank waited in dist.barrier() between two steps
BARRIER_WAIT_MARK = "stepwatch.barrier_wait_ms"
_STEP_SELECT = ", ".join(COLUMNS)  # rank, step, clocks, step_ns, then the phases (stepwatch.phases)
_MEMORY_SELECT = "rank, timestamp_ns, event_type, collector, device_id, allocated, reserved, free, total, host"
# each rank and its last step, by seeks down steps_unique (session_key, rank, step)
_LAST_STEPS = SESSION_RANKS + """SELECT rank, (SELECT step FROM steps WHERE session_id = ?1 AND rank = ranks.rank ORDER BY step DESC LIMIT 1) AS last
FROM ranks WHERE rank IS NOT NULL
"""


class VerdictInputs(NamedTuple):
    """``diagnose(steps, memory, system, window=..., expected_ranks=...)``'s arguments."""

    steps: Sequence[Mapping[str, Any]]  # StepColumns (a sequence of row dicts too); [] with no step
    memory: list[dict[str, Any]]
    system: list[dict[str, Any]]
    expected_ranks: tuple[int, ...] = ()
    window: int | None = None
    barrier_wait_ns: Mapping[int, float] | None = None  # rank -> ns waited in dist.barrier() between steps


def session_steps(store: HistoryStore, session_id: str) -> StepColumns:
    """Every step row of ``session_id`` as columns, by rank and step: the one read the final
    summary's statistics and its diagnosis share (``load_verdict_inputs(steps=...)``), in the
    order the store reads fastest, sorted here."""
    return StepColumns.from_tuples(store.step_tuples(session_id, COLUMNS)).by_rank_and_step()


def load_verdict_inputs(store: HistoryStore, session_id: str, *, last_steps: int | None = None,
                        steps: StepColumns | None = None) -> VerdictInputs:
    """The rows of ``session_id``'s window: the last ``last_steps`` steps completed on every rank
    (None: every step completed on every rank), the memory samples taken during them, and the
    NVML utilisation samples of the same span. ``steps``: the session's rows, already read
    (``session_steps``): the window is taken from them instead of read again. Raises StoreError
    on a damaged history."""
    expected = _expected_ranks(store, session_id)
    if steps is not None:
        lasts = _rank_last_steps(steps)
    else:
        # a store whose SQL has no recursive CTE (ClickHouse) answers the same question its own way
        own = getattr(store, "rank_last_steps", None)
        found = own(session_id) if own is not None else store.query(_LAST_STEPS, (session_id,))
        lasts = {int(r["rank"]): int(r["last"]) for r in found if r["last"] is not None}
    if not lasts:
        return VerdictInputs([], [], [], expected, last_steps)
    ranks = sorted(lasts)
    high = min(lasts.values())
    low = None if last_steps is None else high - max(1, int(last_steps)) + 1
    marks = ", ".join("?" * len(ranks))
    if steps is not None:
        step = steps.arrays["step"]
        steps = steps.take((step <= high) if low is None else ((step >= low) & (step <= high)))
    else:
        where, bounds = ("step <= ?", (high,)) if low is None else ("step BETWEEN ? AND ?", (low, high))
        sql = (f"SELECT {_STEP_SELECT} FROM steps WHERE session_id = ? AND rank IN ({marks}) AND {where} "
               "ORDER BY rank, step")
        steps = _step_columns(store, sql, (session_id, *ranks, *bounds))
    span = steps.span()
    if span is None:
        return VerdictInputs(steps, [], [], expected, last_steps)
    memory = store.query(f"SELECT {_MEMORY_SELECT} FROM telemetry WHERE session_id = ? AND rank IN ({marks}) "
                         f"AND timestamp_ns BETWEEN ? AND ? AND event_type = 'sample' ORDER BY rank, timestamp_ns",
                         (session_id, *ranks, *span))
    system = _gpu_utilisation(store, session_id, ranks, span)
    waits = store.query(f"SELECT rank, SUM(value_num) AS waited FROM marks WHERE session_id = ? AND name = ? "
                        f"AND rank IN ({marks}) AND ts_ns BETWEEN ? AND ? GROUP BY rank",
                        (session_id, BARRIER_WAIT_MARK, *ranks, *span))
    barrier = {int(r["rank"]): float(r["waited"]) * 1e6 for r in waits if isinstance(r["waited"], int | float)}
    return VerdictInputs(steps, memory, system, expected, last_steps, barrier)


def _rank_last_steps(steps: StepColumns) -> dict[int, int]:
    """Each rank's last step, from rows ordered by rank and step (a rank or step that is no
    whole number makes no row of the window, as in the history's own columns)."""
    import numpy as np

    rank, step = steps.arrays["rank"], steps.arrays["step"]
    usable = ~(np.isnan(rank) | np.isnan(step))
    rank, step = rank[usable], step[usable]
    if not len(rank):
        return {}
    ends = np.flatnonzero(np.append(rank[1:] != rank[:-1], True))  # the last row of each rank
    return {int(rank[i]): int(step[i]) for i in ends}


def _step_columns(store: HistoryStore, sql: str, params: tuple[Any, ...]) -> StepColumns:
    """The window's step rows as columns: as column lists where the store reads them so (the
    ClickHouse store: its native blocks), from tuples where it gives them, else from rows."""
    column_lists = getattr(store, "query_column_lists", None)
    if column_lists is not None:
        return StepColumns.from_lists(column_lists(sql, params), no_bools=True)
    query_tuples = getattr(store, "query_tuples", None)
    if query_tuples is not None:
        return StepColumns.from_tuples(query_tuples(sql, params))
    return StepColumns.from_rows(store.query(sql, params))


def _expected_ranks(store: HistoryStore, session_id: str) -> tuple[int, ...]:
    rows = store.query("SELECT world_size FROM sessions WHERE session_id = ?", (session_id,))
    world = rows[0]["world_size"] if rows else None
    return tuple(range(world)) if isinstance(world, int) and 0 < world <= 1 << 16 else ()


def _gpu_utilisation(store: HistoryStore, session_id: str, ranks: list[int], span: tuple[int, int]) -> list[dict[str, Any]]:
    """NVML samples that carry the device's utilisation (``gpu_util_pct`` in their metadata)."""
    marks = ", ".join("?" * len(ranks))
    rows = store.query(f"SELECT rank, timestamp_ns, device_id, metadata FROM telemetry WHERE session_id = ? "
                       f"AND rank IN ({marks}) AND timestamp_ns BETWEEN ? AND ? AND event_type = 'sample' "
                       f"AND collector = 'stepwatch.nvml_tracker' AND metadata LIKE '%gpu_util_pct%'",
                       (session_id, *ranks, *span))
    out = []
    for row in rows:
        try:
            metadata = json.loads(row["metadata"] or "{}")
        except ValueError:
            continue
        value = metadata.get("gpu_util_pct") if isinstance(metadata, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append({"rank": row["rank"], "timestamp_ns": row["timestamp_ns"], "device_id": row["device_id"],
                        "gpu_util_pct": value})
    return out


def diagnose_store(store: HistoryStore, session_id: str, *, window: int | None = None,
                   policy: VerdictPolicy | None = None, inputs: VerdictInputs | None = None) -> Diagnosis:
    """``diagnose`` on ``session_id``'s window (all its steps when ``window`` is None), read from
    ``store`` unless the caller loaded ``inputs`` already (the live thread keeps them for the
    verdict's row); the advice names the loader and optimizer settings the capture recorded."""
    from .engine import diagnose

    if inputs is None:
        inputs = load_verdict_inputs(store, session_id, last_steps=window)
    found = diagnose(inputs.steps, inputs.memory, inputs.system, window=window,
                     policy=DEFAULT_POLICY if policy is None else policy, expected_ranks=inputs.expected_ranks,
                     barrier_wait_ns=inputs.barrier_wait_ns)
    from ..program_settings import load_program_settings, with_settings  # the advice names the program's settings

    return with_settings(found, load_program_settings(store, session_id))
