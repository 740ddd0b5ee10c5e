"""``stepwatch export mlflow`` on the shared real two-rank run, into a real MLflow SQLite
tracking store, read back with ``MlflowClient``: params, a metric point per rank per step with
the history's values, the summary's figures, tags, artifacts, and a run per rank with
``--per-rank``."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepwatch.ui.cli import cli
from tests.support import needs
from tests.support.shared import once
from tests.support.trace_run import STEPS_PER_RANK, trace_run

pytestmark = [
    pytest.mark.real,  # the run is a real stepwatch run (torchrun, two ranks)
    # MLflow 3.17's SQLite store still asks SQLAlchemy 2.1 for a loader strategy it deprecates
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
    needs("mlflow"),
]

pytest.importorskip("torch")


def _export(*args: str) -> list[str]:
    result = CliRunner().invoke(cli, ["export", "mlflow", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.split()


def _exported(base: Path, shared: Path) -> tuple[Path, str, str]:
    copy = base / "run"  # a copy of the shared run: the default tracking store is written into the run directory
    shutil.copytree(shared, copy)
    (run_id,) = _export(str(copy))  # the default store: sqlite:///RUN_DIR/mlflow.db
    (again,) = _export(str(copy))  # the same session again: its run is found and kept
    return copy, run_id, again


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(the run's copy, the MLflow run id, the second export's): exported once for every worker."""
    shared = trace_run(tmp_path_factory)
    return once(tmp_path_factory, "exports-mlflow-session", lambda base: _exported(base, shared))


@pytest.fixture(scope="module")
def run(exported: tuple[Path, str, str]) -> Path:
    return exported[0]


@pytest.fixture(scope="module")
def client(run: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")


@pytest.fixture(scope="module")
def session_run(exported: tuple[Path, str, str], client: Any) -> Any:
    return client.get_run(exported[1])


def _rows(run: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return db.execute(sql).fetchall()


def _live_runs(client: Any, experiment_id: str) -> list[Any]:
    from mlflow.entities import ViewType

    return list(client.search_runs([experiment_id], run_view_type=ViewType.ACTIVE_ONLY))


def test_exporting_again_keeps_the_one_run(exported: tuple[Path, str, str], session_run: Any, client: Any) -> None:
    assert exported[1] == exported[2]
    assert [r.info.run_id for r in _live_runs(client, session_run.info.experiment_id)] == [exported[1]]
    assert len(session_run.data.tags["stepwatch.digest"]) == 64
    # each point once (the metric test below counts them all): the second export logged none
    assert len(client.get_metric_history(exported[1], "summary/steps")) == 1


def test_one_run_per_session_with_the_params_tags_and_status(run: Path, session_run: Any, client: Any) -> None:
    assert (run / "mlflow.db").is_file()
    info, data = session_run.info, session_run.data
    assert client.get_experiment(info.experiment_id).name == "stepwatch"
    assert info.status == "FINISHED" and info.run_name.startswith("stepwatch ")
    manifest = json.loads((run / "run.json").read_text())
    assert data.tags["stepwatch.session_id"] == manifest["session_id"]
    assert data.tags["stepwatch.outcome"] == "succeeded"
    assert data.tags["stepwatch.verdict"]  # the diagnosis's primary verdict
    params = data.params
    assert params["world_size"] == "2" and params["command"].endswith("trace_train.py")
    assert params["optimizer/class"] == "SGD" and params["optimizer/lr"] == "0.01"
    assert params["dataloader/batch_size"] == "16" and params["dataloader/num_workers"] == "0"
    assert params["version/stepwatch"]
    torch = pytest.importorskip("torch")
    assert params["version/torch"] == torch.__version__  # from the ranks: the launcher never imports torch
    summary = json.loads((run / "final_summary.json").read_text())
    assert (info.start_time, info.end_time) == (summary["started_at_ns"] // 1_000_000, summary["ended_at_ns"] // 1_000_000)


def test_a_metric_point_per_rank_per_step_with_the_historys_values(run: Path, session_run: Any, client: Any) -> None:
    run_id = session_run.info.run_id
    for rank in (0, 1):
        steps = _rows(run, f"SELECT step, step_ns, end_ns FROM steps WHERE rank = {rank} ORDER BY step")
        history = sorted(client.get_metric_history(run_id, f"rank_{rank}/step_time_ms"), key=lambda m: m.step)
        assert [(m.step, m.timestamp) for m in history] == [(s, end // 1_000_000) for s, _, end in steps]
        assert [m.value for m in history] == pytest.approx([ns / 1e6 for _, ns, _ in steps], rel=1e-9)
        for key in ("steps_per_s", "phase_share/backward", "memory/rss_bytes", "mark/loss"):
            assert len(client.get_metric_history(run_id, f"rank_{rank}/{key}")) == STEPS_PER_RANK, key
    summary = json.loads((run / "final_summary.json").read_text())
    assert session_run.data.metrics["summary/steps"] == summary["overall"]["steps"]
    assert session_run.data.metrics["summary/step_ms_median"] == pytest.approx(summary["overall"]["step_ms"]["median"])


def test_the_summary_diagnosis_report_and_trace_are_artifacts(run: Path, session_run: Any, client: Any,
                                                               tmp_path: Path) -> None:
    run_id = session_run.info.run_id
    names = {a.path for a in client.list_artifacts(run_id)}
    assert names == {"summary.json", "summary.txt", "diagnosis.json", "report.html", "trace.json"}
    assert session_run.info.artifact_uri.startswith((run / "mlartifacts").as_uri())  # beside the store, not ./mlruns
    local = Path(client.download_artifacts(run_id, "trace.json", str(tmp_path)))
    trace = json.loads(local.read_text())
    assert {e["ph"] for e in trace["traceEvents"]} >= {"X", "M"}
    diagnosis = json.loads(Path(client.download_artifacts(run_id, "diagnosis.json", str(tmp_path))).read_text())
    assert diagnosis["primary"]["name"] == session_run.data.tags["stepwatch.verdict"]
    assert "<html" in Path(client.download_artifacts(run_id, "report.html", str(tmp_path))).read_text()[:500].lower()


def test_per_rank_makes_a_run_per_rank_in_the_named_experiment(run: Path, client: Any, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from stepwatch.exports.mlflow_export import export_mlflow
    from stepwatch.exports.tracker_data import tracker_points
    from stepwatch.store.sqlite import SqliteStore

    uri = f"sqlite:///{tmp_path / 'other.db'}"
    session = json.loads((run / "run.json").read_text())["session_id"]
    store = SqliteStore(run / "history.sqlite", read_only=True)
    try:
        points = tracker_points(store, session)
    finally:
        store.close()
    # what an export made while the run trained holds: its first steps only
    early = export_mlflow([p for p in points if p.step < 5], {"world_size": "2"}, {},
                          {"stepwatch.session_id": session}, [], tracking_uri=uri, experiment="ranks", per_rank=True,
                          run_name="early", start_ms=None, end_ms=None)
    ids = _export(str(run), "--per-rank", "--experiment", "ranks", "--tracking-uri", uri)
    assert _export(str(run), "--per-rank", "--experiment", "ranks", "--tracking-uri", uri) == ids  # kept
    other = MlflowClient(tracking_uri=uri)
    assert set(ids).isdisjoint(early.run_ids.values())  # the early runs held other points: made anew
    assert {r.info.run_id for r in _live_runs(other, early.experiment_id)} == set(ids)
    assert all(other.get_run(i).info.lifecycle_stage == "deleted" for i in early.run_ids.values())
    runs = [other.get_run(i) for i in ids]
    assert [r.data.tags["stepwatch.rank"] for r in runs] == ["0", "1"]
    for rank, r in enumerate(runs):
        assert other.get_experiment(r.info.experiment_id).name == "ranks"
        steps = _rows(run, f"SELECT step FROM steps WHERE rank = {rank} ORDER BY step")
        history = other.get_metric_history(r.info.run_id, "step_time_ms")  # no rank prefix in a rank's own run
        assert sorted(m.step for m in history) == [s for (s,) in steps]
        assert r.data.params["world_size"] == "2"
