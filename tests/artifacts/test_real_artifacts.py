"""Real artifacts read whole: v2 exports with the published identity fields, Stormlog's v4
records with unknown (null) counters, and documents nested deeper than any decoder recurses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from stepwatch.telemetry import load_telemetry_sessions
from tests.conftest import make_record


def v2_record(**overrides: Any) -> dict[str, Any]:
    record = make_record(schema_version=2)
    for name in ("session_id", "job_id", "rank", "local_rank", "world_size"):
        del record[name]
    record.update(overrides)
    return record


def test_a_distributed_v2_export_loads_with_its_identity(tmp_path: Path) -> None:
    records = [v2_record(timestamp_ns=i, job_id="job-1", rank=r, local_rank=r, world_size=2)
               for i, r in enumerate([0, 1, 0, 1])]
    path = tmp_path / "export.json"
    path.write_bytes(msgspec.json.encode({"events": records}))
    [loaded] = load_telemetry_sessions(path)
    assert [(e.rank, e.world_size, e.job_id) for e in loaded.events] == [(r, 2, "job-1") for r in [0, 1, 0, 1]]
    assert loaded.summary.ranks == (0, 1)
