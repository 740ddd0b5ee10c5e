"""The live verdicts' evaluator (server/live_verdicts.py) over a real SQLite history that grows
as the aggregator's would, and the diagnosis's text (analysis/diagnosis.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.analysis.markers import derive_verdict_markers
from stepwatch.analysis.verdicts.diagnosis import diagnosis_lines, evidence_text, verdict_line
from stepwatch.server.live_verdicts import INTERVAL_ENV, LiveVerdicts, interval_from_env
from stepwatch.store.sqlite import SqliteStore
from tests.support import examples
from tests.support.verdict_rows import steps

SESSION = "00000000-0000-4000-8000-00000000000a"


class History:
    """A writer's store, and the live evaluator reading it through its own read-only connection."""

    def __init__(self, tmp_path: Path, ranks: int = 2) -> None:
        self.store = SqliteStore(tmp_path / "history.sqlite")
        self.store.upsert_session({"session_id": SESSION, "status": "running", "started_at_ns": 1, "ended_at_ns": None,
                                   "host": "h", "world_size": ranks, "source": "test", "command_line": None})
        self.ranks = ranks
        self.next_step = 0
        self.t = 1_800_000_000_000_000_000
        self.events: list[dict[str, Any]] = []
        self.rows: list[tuple[str, dict[str, Any]]] = []
        self.live = LiveVerdicts(tmp_path / "history.sqlite", progress=self.progress, emit=self.events.append,
                                 store_row=lambda table, row: self.rows.append((table, row)), interval_s=60)

    def progress(self) -> dict[str, tuple[int, set[int]]]:
        return {SESSION: (self.next_step, set(range(self.ranks)))}

    def add(self, count: int, **shape: Any) -> None:
        for rank in range(self.ranks):
            rows = steps(rank, count, first=self.next_step, t0=self.t, **shape)
            self.store.append("steps", [{"session_id": SESSION, **r} for r in rows])
        self.t = rows[-1]["end_ns"] + 1_000_000
        self.next_step += count

    def close(self) -> None:
        self.live.stop()
        if self.live._store is not None:  # tick() ran on this thread: its connection
            self.live._store.close()
        self.store.close()


def test_a_change_is_reported_once_it_holds_and_stored(tmp_path: Path) -> None:
    history = History(tmp_path)
    try:
        history.add(150)
        history.live.tick()
        assert history.events == []  # seen once: not yet confirmed
        history.add(10)
        history.live.tick()
        first = [e["verdict"]["name"] for e in history.events]
        assert first and first[0] in ("BALANCED", "COMPUTE_BOUND") and history.events[0]["line"].startswith(
            f"[stepwatch] verdict {first[0]} (info")
        history.live.tick()  # no new step: not evaluated again, nothing said
        assert len(history.events) == 1 and history.live.evaluations == 2
        history.add(120, fetch=6.0)  # the loader turns slow: the last 100 steps are input bound
        history.live.tick()
        assert len(history.events) == 1
        history.add(5, fetch=6.0)
        history.live.tick()
        assert [e["verdict"]["name"] for e in history.events] == [first[0], "INPUT_BOUND"]
        event = history.events[-1]
        assert event["event"] == "verdict" and event["session_id"] == SESSION
        assert event["line"].startswith("[stepwatch] verdict INPUT_BOUND (crit ranks 0, 1): ")
        assert "next step: more DataLoader workers" in event["line"]
        table, row = history.rows[-1]
        assert table == "verdicts" and row["name"] == "INPUT_BOUND" and row["window_steps"] == 100
        assert row["step"] == history.next_step - 1 and row["evidence"]["window"]["steps"] == 100
        history.store.append("verdicts", [r for _, r in history.rows])  # the table takes the rows as made
        stored = history.store.query("SELECT name, ranks FROM verdicts ORDER BY ts_ns")
        assert [r["name"] for r in stored] == [first[0], "INPUT_BOUND"] and json.loads(stored[-1]["ranks"]) == [0, 1]
        markers = derive_verdict_markers(history.store.query("SELECT * FROM verdicts ORDER BY ts_ns"), world_size=2)
        assert [m.kind for m in markers] == ["verdict", "verdict"] and markers[-1].severity == "critical"
        assert markers[-1].metadata["ranks"] == [0, 1]
    finally:
        history.close()


def test_a_verdict_flapping_every_evaluation_is_not_reported(tmp_path: Path) -> None:
    history = History(tmp_path, ranks=1)
    try:
        for i in range(6):
            history.add(100, fetch=6.0 if i % 2 else 0.2)
            history.live.tick()
        assert history.events == [] and history.rows == []
    finally:
        history.close()


def test_an_evaluation_of_a_long_history_reads_only_its_window(tmp_path: Path) -> None:
    history = History(tmp_path, ranks=8)
    try:
        history.add(5000)
        history.live.tick()
        history.add(5)
        started = time.perf_counter()
        history.live.tick()
        spent = time.perf_counter() - started
        assert history.live.errors == 0 and spent < 0.5, spent  # ~10 ms: the window, not 40k rows
    finally:
        history.close()


def test_the_interval_comes_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert interval_from_env() == 3.0
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_from_env() == 0.5
    for off in ("0", "-1", "soon"):
        monkeypatch.setenv(INTERVAL_ENV, off)
        assert interval_from_env() == 0.0


def test_the_thread_stops_promptly(tmp_path: Path) -> None:
    history = History(tmp_path, ranks=1)
    history.live.interval_s = 0.05
    history.live.start()
    history.add(60)
    time.sleep(0.3)
    started = time.perf_counter()
    history.close()
    assert time.perf_counter() - started < 2 and history.live.errors == 0 and history.live.evaluations >= 1


verdicts = st.fixed_dictionaries({
    "name": st.text(max_size=20), "severity": st.sampled_from(["info", "warn", "crit", "odd"]),
    "score": st.one_of(st.none(), st.floats(allow_nan=True), st.integers()),
    "ranks": st.lists(st.integers(-2, 300), max_size=5), "message": st.text(max_size=80),
    "next_step": st.one_of(st.none(), st.text(max_size=40)),
    "evidence": st.dictionaries(st.text(max_size=10), st.recursive(
        st.one_of(st.none(), st.floats(), st.integers(), st.text(max_size=10)),
        lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
        max_leaves=8), max_size=6)})


@settings(max_examples=examples(100), deadline=None)
@given(st.one_of(st.none(), verdicts), st.lists(verdicts, max_size=4), st.lists(verdicts, max_size=3))
def test_any_diagnosis_renders_as_lines_primary_first(primary: Any, step_time: list[Any], memory: list[Any]) -> None:
    lines = diagnosis_lines({"primary": primary, "step_time": step_time, "memory": memory, "system": []})
    assert lines and lines[0].startswith("diagnosis")
    if primary:
        assert lines[0] == f"diagnosis {verdict_line(primary)}"
        assert isinstance(evidence_text(primary["evidence"]), str)
        others = [m for m in memory if not (m["name"] == primary["name"] and m["ranks"] == primary["ranks"])]
        assert sum(line.startswith("  also ") for line in lines) >= len(others)


def test_no_diagnosis_no_lines() -> None:
    assert diagnosis_lines(None) == [] and diagnosis_lines("junk") == []  # type: ignore[arg-type]
