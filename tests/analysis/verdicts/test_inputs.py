"""Reading the verdicts' inputs from a real SQLite history: only the window's rows, through
index seeks whose cost does not grow with the history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepwatch.analysis.verdicts.inputs import diagnose_store, load_verdict_inputs
from stepwatch.store.sqlite import SqliteStore
from tests.support.verdict_rows import CPU, steps
from tests.support.verdict_rows import memory as samples

SID = "00000000-0000-4000-8000-0000000000aa"
OTHER = "00000000-0000-4000-8000-0000000000bb"


def telemetry(row: dict[str, Any], session: str = SID) -> dict[str, Any]:
    return {"session_id": session, "rank": row["rank"], "timestamp_ns": row["timestamp_ns"],
            "event_type": row.get("event_type", "sample"), "collector": row["collector"],
            "device_id": row["device_id"], "allocated": row.get("allocated"), "reserved": row.get("reserved"),
            "active": None, "inactive": None, "change": 0, "used": row.get("allocated"), "free": row.get("free"),
            "total": row.get("total"), "pid": 1, "host": row.get("host", "h"), "context": None,
            "metadata": row.get("metadata", {})}


def history(path: Path, counts: dict[int, int], *, fetch: float = 3.0, world: int | None = None,
            session: str = SID) -> SqliteStore:
    store = SqliteStore(path)
    store.upsert_session({"session_id": session, "status": "running", "started_at_ns": 0, "ended_at_ns": None,
                          "host": "h", "world_size": world, "source": "test", "command_line": None})
    rows: list[dict[str, Any]] = []
    for rank, count in counts.items():
        rows += steps(rank, count, fetch=fetch)
    store.append("steps", [{**r, "session_id": session} for r in rows])
    mem = []
    for rank in counts:
        mine = [r for r in rows if r["rank"] == rank]
        mem += samples(rank, mine, [1 << 30] * len(mine))
    store.append("telemetry", [telemetry(m, session) for m in mem])
    return store


def test_the_live_window_reads_only_its_rows(tmp_path: Path) -> None:
    store = history(tmp_path / "h.sqlite", {0: 500, 1: 480}, world=3)
    history(tmp_path / "h.sqlite", {0: 50}, session=OTHER).close()  # another session beside it
    try:
        inputs = load_verdict_inputs(store, SID, last_steps=100)
        assert len(inputs.steps) == 200
        assert {r["step"] for r in inputs.steps} == set(range(380, 480))  # completed on every rank
        assert inputs.expected_ranks == (0, 1, 2)
        assert len(inputs.memory) == 200 and all(m["collector"] == CPU for m in inputs.memory)
        whole = load_verdict_inputs(store, SID)
        assert len(whole.steps) == 960 and max(r["step"] for r in whole.steps) == 479
        diagnosis = diagnose_store(store, SID, window=100)
        assert diagnosis.primary.name == "INPUT_BOUND"
        assert diagnosis.primary.evidence["window"]["first_step"] == 380
        incomplete = next(v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA")
        assert incomplete.ranks == (2,)  # world size 3, rank 2 never stepped
    finally:
        store.close()


def test_an_empty_or_unknown_session_is_insufficient_data(tmp_path: Path) -> None:
    store = history(tmp_path / "h.sqlite", {})
    try:
        assert load_verdict_inputs(store, "nope", last_steps=100).steps == []
        assert diagnose_store(store, SID).primary.name == "INSUFFICIENT_STEP_TIME_DATA"
    finally:
        store.close()


def test_null_phase_columns_stay_unknown(tmp_path: Path) -> None:
    store = history(tmp_path / "h.sqlite", {0: 100, 1: 100})
    try:
        store._db.execute("UPDATE steps_rows SET backward_ns = NULL WHERE rank = 1")
        inputs = load_verdict_inputs(store, SID)
        assert all(r["backward_ns"] is None for r in inputs.steps if r["rank"] == 1)
        diagnosis = diagnose_store(store, SID)
        assert not any("STRAGGLER" in v.name for v in diagnosis.step_time)
        assert next(v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA").ranks == (1,)
    finally:
        store.close()


def test_gpu_utilisation_comes_from_nvml_samples(tmp_path: Path) -> None:
    store = history(tmp_path / "h.sqlite", {0: 100})
    try:
        rows = load_verdict_inputs(store, SID).steps
        nvml = [{"rank": 0, "timestamp_ns": r["start_ns"] + 1, "collector": "stepwatch.nvml_tracker", "device_id": 0,
                 "allocated": 1, "reserved": 1, "free": 1, "total": 2, "metadata": {"gpu_util_pct": 9}}
                for r in rows[::10]]
        store.append("telemetry", [telemetry(n) for n in nvml])
        inputs = load_verdict_inputs(store, SID, last_steps=100)
        assert [s["gpu_util_pct"] for s in inputs.system] == [9] * 10
        assert [v.name for v in diagnose_store(store, SID).system] == ["GPU_UTILIZATION_LOW"]
    finally:
        store.close()


def _vm_steps(store: SqliteStore, last_steps: int | None) -> int:
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    store._db.set_progress_handler(tick, 100)
    try:
        load_verdict_inputs(store, SID, last_steps=last_steps)
    finally:
        store._db.set_progress_handler(None, 100)
    return count[0]


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_live_window_costs_the_same_on_a_long_history(tmp_path: Path, ranks: int) -> None:
    short = history(tmp_path / "short.sqlite", dict.fromkeys(range(ranks), 150))
    long = history(tmp_path / "long.sqlite", dict.fromkeys(range(ranks), 3000))
    try:
        small, large = _vm_steps(short, 100), _vm_steps(long, 100)
        assert large <= small * 1.5 + 50, (small, large)
        assert _vm_steps(long, None) > 10 * large  # the whole history is another matter
    finally:
        short.close()
        long.close()
