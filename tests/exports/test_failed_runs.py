"""The exports and ``stepwatch query`` on runs that did not end well, as users meet them: a
one-rank run that crashed after a non-finite loss, and one killed by SIGKILL mid-step (the
dashboard's shared runs, tests/support/web_runs.py). Each gives a valid trace that keeps what the
run recorded up to its end, and the named questions answer from the same history."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepwatch.ui.cli import cli
from tests.support import run_stepwatch
from tests.support.trace_format import format_problems, names, nesting_problems
from tests.support.web_runs import web_runs

pytestmark = pytest.mark.real  # the runs are real stepwatch runs

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return web_runs(tmp_path_factory)


def _count(run: Path, sql: str) -> int:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return int(db.execute(sql).fetchone()[0])


def _query(run: Path, *args: str) -> list[dict[str, Any]]:
    proc = run_stepwatch("query", str(run), *args, "--format", "json", cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    rows: list[dict[str, Any]] = json.loads(proc.stdout)
    return rows


@pytest.mark.parametrize("name", ["crashed", "killed"])
def test_a_run_that_ended_badly_exports_a_valid_trace_of_what_it_recorded(
        runs: dict[str, Path], name: str, tmp_path: Path) -> None:
    run = runs[name]
    out = tmp_path / "trace.json"
    proc = run_stepwatch("export", "perfetto", str(run), "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert format_problems(trace) == [] and nesting_problems(events) == []
    assert set(names(events, "process_name").values()) == {f"rank 0 @ {_host(run)}"}  # one rank
    # every step the history holds: from its span, or from the step ledger where a killed rank's
    # spans were never shipped
    steps = {e["name"] for e in events if e["ph"] == "X" and e["name"].startswith("step ")}
    assert len(steps) == _count(run, "SELECT COUNT(*) FROM steps") > 0


def test_the_crashed_runs_alert_is_in_its_trace_and_its_named_questions(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["crashed"]
    out = tmp_path / "trace.json"
    assert run_stepwatch("export", "perfetto", str(run), "-o", str(out), cwd=tmp_path).returncode == 0
    alerts = _query(run, "--alerts")
    kinds = {a["kind"] for a in alerts}
    assert "NONFINITE" in kinds, alerts
    instants = {e["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "i"}
    assert any("NONFINITE" in name for name in instants), instants
    sessions = _query(run, "--sessions")
    assert len(sessions) == 1 and sessions[0]["alerts"] == len(alerts) >= 1, sessions


def test_the_killed_runs_session_reads_killed_and_keeps_its_steps(runs: dict[str, Path]) -> None:
    run = runs["killed"]
    sessions = _query(run, "--sessions")
    steps = _query(run, "SELECT COUNT(*) AS n, MAX(step) AS last FROM steps")
    assert len(sessions) == 1 and sessions[0]["step_rows"] == steps[0]["n"], sessions
    assert steps[0]["n"] >= 20 and steps[0]["last"] < 59  # killed at step 25 of 60: what it closed is kept


def _host(run: Path) -> str:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return str(db.execute("SELECT MAX(host) FROM telemetry WHERE rank = 0").fetchone()[0])


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # MLflow's, on SQLAlchemy 2.1
@pytest.mark.parametrize("name", ["crashed", "killed"])
def test_a_run_that_ended_badly_goes_to_tensorboard_and_mlflow_with_every_step_it_closed(
        runs: dict[str, Path], name: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs[name]
    steps = _count(run, "SELECT COUNT(*) FROM steps WHERE rank = 0")
    proc = run_stepwatch("export", "tensorboard", str(run), "-o", str(tmp_path / "tb"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    acc = EventAccumulator(str(tmp_path / "tb" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("step_time_ms")) == steps > 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # in this process: MLflow's import (6 s of CPU) is paid once per worker, not once per export
    result = CliRunner().invoke(cli, ["export", "mlflow", str(run), "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert found.info.status in ("FAILED", "KILLED")  # how the training ended, not FINISHED
    assert len(client.get_metric_history(found.info.run_id, "rank_0/step_time_ms")) == steps
