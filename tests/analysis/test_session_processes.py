"""``session_processes`` reads the ``process`` object of start records (capture/children.py) from
a real SQLite history: whatever the metadata holds, it never raises, names as workers exactly the
keys whose start record says so, and takes the largest world size the spawned ranks reported."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.analysis.summary import session_processes
from stepwatch.store.sqlite import SqliteStore
from tests.support import examples

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=8)
_process = st.one_of(
    _json,
    st.fixed_dictionaries({"role": st.sampled_from(["worker", "rank", "main", 7]),
                           "world_size": st.one_of(st.integers(1, 64), st.text(max_size=2), st.none())}),
)


def _row(rank: int, metadata: Any, i: int) -> dict[str, Any]:
    return {"session_id": "s", "rank": rank, "timestamp_ns": i, "event_type": "start", "collector": "c",
            "device_id": -1, "allocated": 0, "reserved": 0, "active": None, "inactive": None, "change": 0,
            "used": 0, "free": None, "total": None, "pid": 1, "host": "h", "context": None,
            "metadata": metadata}


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 6), _process), max_size=8))
def test_workers_and_world_size_come_from_the_start_records(starts: list[tuple[int, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp, SqliteStore(Path(tmp) / "h.sqlite") as store:
        store.append("telemetry", [_row(rank, {"process": process}, i) for i, (rank, process) in enumerate(starts)])
        world, workers = session_processes(store, "s")
    processes = [(rank, p) for rank, p in starts if isinstance(p, dict)]
    assert workers == sorted({rank for rank, p in processes if p.get("role") == "worker"})
    sizes = [p["world_size"] for _, p in processes if p.get("role") != "worker"
             and isinstance(p.get("world_size"), int) and not isinstance(p.get("world_size"), bool)]
    assert world == max(sizes, default=0)
