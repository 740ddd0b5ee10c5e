"""The rules of ``stepwatch.exports.tracker_data`` over a real SQLite history of generated steps,
memory samples and marks: each mark lands in the step the docs say (the first step that ended at
or after it; the program's own mark over an inferred one), a step's memory is the last sample at
or before its end, and ``steps_per_s`` is the trailing window's rate."""

from __future__ import annotations

import bisect
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stepwatch.exports.tracker_data import RATE_WINDOW, tracker_points
from stepwatch.phases import STEP_COLUMNS
from stepwatch.store.sqlite import SqliteStore

SESSION = "00000000-0000-0000-0000-000000000001"
T0 = 1_790_000_000_000_000_000


def _store(folder: Path, durations: list[int], samples: list[tuple[int, int]],
           marks: list[tuple[int, float, bool]]) -> SqliteStore:
    store = SqliteStore(folder / "history.sqlite")
    store.upsert_session({"session_id": SESSION, "status": "completed", "started_at_ns": T0, "ended_at_ns": None,
                          "host": "h", "world_size": 1, "source": "test", "command_line": ["t.py"]})
    steps: list[dict[str, Any]] = []
    t = T0
    for step, ns in enumerate(durations):
        steps.append({"session_id": SESSION, "rank": 0, "step": step, "start_ns": t, "end_ns": t + ns, "step_ns": ns,
                      **dict.fromkeys(STEP_COLUMNS, ns // 8)})
        t += ns
    telemetry = [{"session_id": SESSION, "rank": 0, "timestamp_ns": T0 + ts, "event_type": "sample",
                  "collector": "stepwatch.cpu_tracker", "device_id": -1, "allocated": value, "reserved": value,
                  "active": None, "inactive": None, "change": 0, "used": value, "free": None, "total": None, "pid": 1,
                  "host": "h", "context": None, "metadata": {}} for ts, value in samples]
    rows = [{"session_id": SESSION, "rank": 0, "mark_id": f"m{i}", "span_id": None, "name": "loss",
             "value_type": "float", "value_num": value, "value_text": None, "ts_ns": T0 + ts, "kind": "point",
             "attrs": {"inferred": True, "source": "backward root"} if inferred else {}}
            for i, (ts, value, inferred) in enumerate(marks)]
    store.append_many({"steps": steps, "telemetry": telemetry, "marks": rows})
    return store


durations = st.lists(st.integers(1_000, 50_000_000), min_size=1, max_size=30)
times = st.integers(0, 40 * 50_000_000)


@given(durations, st.lists(st.tuples(times, st.integers(1, 2**40)), max_size=20, unique_by=lambda s: s[0]),
       st.lists(st.tuples(times, st.floats(-1e6, 1e6), st.booleans()), max_size=20, unique_by=lambda m: m[0]))
def test_marks_memory_and_rates_follow_the_documented_rules(
        durations: list[int], samples: list[tuple[int, int]], marks: list[tuple[int, float, bool]]) -> None:
    with tempfile.TemporaryDirectory() as tmp, _store(Path(tmp), durations, samples, marks) as store:
        points = tracker_points(store, SESSION)
    ends = [sum(durations[:i + 1]) for i in range(len(durations))]
    assert [p.step for p in points] == list(range(len(durations)))
    expected_marks: dict[int, tuple[bool, float]] = {}  # step -> (the program's own, value)
    for ts, value, inferred in sorted(marks):
        step = min(bisect.bisect_left(ends, ts), len(ends) - 1)
        if inferred and expected_marks.get(step, (False, 0.0))[0]:
            continue
        expected_marks[step] = (not inferred, value)
    for i, point in enumerate(points):
        assert point.end_ns == T0 + ends[i]
        assert point.values["step_time_ms"] == durations[i] / 1e6
        assert point.values["phase_share/forward"] == (durations[i] // 8) / durations[i]
        back = min(i, RATE_WINDOW)
        rate = back / ((ends[i] - ends[i - back]) / 1e9) if back else 1e9 / durations[i]
        assert abs(point.values["steps_per_s"] - rate) <= 1e-9 * rate
        before = [value for ts, value in sorted(samples) if ts <= ends[i]]
        assert point.values.get("memory/rss_bytes") == (float(before[-1]) if before else None)
        assert point.values.get("mark/loss") == (expected_marks[i][1] if i in expected_marks else None)
