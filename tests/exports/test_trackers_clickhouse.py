"""The tracker exports (TensorBoard, MLflow, W&B) of a session on a ClickHouse store (Debian's
18.16 server): the points and params they write equal the same run's on SQLite (the
session-shared two-rank run imported into both: tests/support/clickhouse.py), and ``export
tensorboard URL --session ID`` writes the event files the SQLite store's export writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepwatch.exports.tracker_data import tracker_params, tracker_points
from stepwatch.store import open_store
from stepwatch.store.sqlite import SqliteStore
from stepwatch.ui.cli import cli
from tests.support.clickhouse import imported_trace_run

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def imported(clickhouse_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return imported_trace_run(tmp_path_factory, clickhouse_server)


def test_the_points_and_params_of_a_url_equal_sqlites(imported: dict[str, Any]) -> None:
    sid = imported["session_id"]
    with SqliteStore(imported["sqlite"], read_only=True) as sqlite:
        points, params = tracker_points(sqlite, sid), tracker_params(sqlite, sid, {})
    ch = open_store(imported["url"], read_only=True)
    try:
        assert tracker_points(ch, sid) == points
        assert tracker_params(ch, sid, {}) == params
    finally:
        ch.close()
    assert {p.rank for p in points} == {0, 1}
    # the marks went to their steps through the span chain (the loss, on every step)
    assert all("mark/loss" in p.values for p in points if p.step >= 0), [p for p in points if "mark/loss" not in p.values]


def test_export_tensorboard_of_a_url_writes_the_sqlite_stores_scalars(imported: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sid = imported["session_id"]
    scalars = []
    for source, out in ((imported["url"], tmp_path / "ch"), (str(imported["sqlite"]), tmp_path / "sqlite")):
        result = CliRunner().invoke(cli, ["export", "tensorboard", source, "--session", sid, "-o", str(out)])
        assert result.exit_code == 0, result.output
        acc = EventAccumulator(str(out / "rank_1"), size_guidance={"scalars": 0})
        acc.Reload()
        scalars.append({tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]})
    assert scalars[0] == scalars[1] and "step_time_ms" in scalars[0] and len(scalars[0]["step_time_ms"]) >= 20
