"""``stepwatch export wandb`` on the shared real two-rank run, exported twice (one run, the
session's id, in place of the first): the W&B offline run, read back record by record with
wandb's own protobuf classes (tests/support/wandb_records.py gives the file's framing), holds a
history row per step with every rank's scalars at the history's values, the params as config,
the summary, and the run's files."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from stepwatch.exports.wandb_export import wandb_run_id
from tests.support import needs, run_stepwatch
from tests.support.shared import once
from tests.support.trace_run import STEPS_PER_RANK
from tests.support.wandb_records import history_rows, read_records

pytestmark = [pytest.mark.real, needs("wandb")]  # the run is a real stepwatch run (torchrun, two ranks)

pytest.importorskip("torch")


def _offline(out: Path, run: Path) -> tuple[Path, list[str]]:
    """The offline run directory of the second of two exports, and the folders the first left."""
    first: list[str] = []
    for n in range(2):
        proc = run_stepwatch("export", "wandb", str(run), "--dir", str(out), "--project", "tests", cwd=out)
        assert proc.returncode == 0, proc.stderr
        (found,) = (out / "wandb").glob("offline-run-*")
        assert proc.stdout.strip() == str(found) and f"wandb sync {found}" in proc.stderr
        assert ("in place of the earlier export" in proc.stderr) == (n == 1), proc.stderr
        first = first or [found.name]
    return found, first


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Exported twice, once for every worker (by processes of their own: wandb starts its core
    service)."""
    return once(tmp_path_factory, "exports-wandb-offline", lambda base: _offline(base, run))


@pytest.fixture(scope="module")
def offline(exported: tuple[Path, list[str]]) -> Path:
    return exported[0]


def test_exporting_again_writes_the_same_run_in_place_of_the_first(run: Path, exported: Any) -> None:
    offline, first = exported
    session = json.loads((run / "run.json").read_text())["session_id"]
    assert offline.name.endswith(f"-{wandb_run_id(session)}") and first[0].endswith(f"-{wandb_run_id(session)}")
    assert [p.name for p in (offline.parent).glob("offline-run-*")] == [offline.name]  # one folder, not two
    (path,) = offline.glob("run-*.wandb")
    assert path.name == f"run-{wandb_run_id(session)}.wandb"
    (record,) = _records(offline, "run")
    assert record.run_id == wandb_run_id(session)


def test_the_run_id_is_the_sessions_letters_and_digits() -> None:
    assert wandb_run_id("5B0C8F4E-3a1d-4c2b-9e7f-0123456789ab") == "5b0c8f4e3a1d4c2b9e7f0123456789ab"
    hashed = wandb_run_id("---")
    assert len(hashed) == 32 and hashed == wandb_run_id("---") != wandb_run_id("--")
    assert len(wandb_run_id("x" * 100)) == 32


def _records(offline: Path, kind: str) -> list[Any]:
    (path,) = offline.glob("run-*.wandb")
    return [getattr(r, kind) for r in read_records(path) if r.WhichOneof("record_type") == kind]


def test_a_history_row_per_step_with_every_ranks_scalars_at_the_historys_values(run: Path, offline: Path) -> None:
    (path,) = offline.glob("run-*.wandb")
    rows = history_rows(path)
    assert [r["_step"] for r in rows] == list(range(STEPS_PER_RANK))
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        steps = db.execute("SELECT rank, step, step_ns, forward_ns, end_ns FROM steps").fetchall()
        losses = db.execute("SELECT rank, value_num FROM marks WHERE name = 'loss' AND attrs NOT LIKE '%inferred%' "
                            "ORDER BY rank, ts_ns").fetchall()
    for rank, step, step_ns, forward_ns, end_ns in steps:
        row = rows[step]
        assert row[f"rank_{rank}/step_time_ms"] == pytest.approx(step_ns / 1e6, rel=1e-9)
        assert row[f"rank_{rank}/phase_share/forward"] == pytest.approx(forward_ns / step_ns, rel=1e-9)
        assert row[f"rank_{rank}/step_end_unix_s"] == pytest.approx(end_ns / 1e9)
        assert row[f"rank_{rank}/steps_per_s"] > 0 and row[f"rank_{rank}/memory/rss_bytes"] > 1e6
    for rank in (0, 1):
        assert [r[f"rank_{rank}/mark/loss"] for r in rows] == pytest.approx(
            [v for r, v in losses if r == rank], rel=1e-9)


def test_the_run_record_holds_the_params_tags_and_the_summary_its_figures(run: Path, offline: Path) -> None:
    (record,) = _records(offline, "run")
    assert record.project == "tests" and record.display_name.startswith("stepwatch ")
    config = {u.key: json.loads(u.value_json) for u in record.config.update}
    assert config["world_size"] == "2" and config["optimizer/class"] == "SGD" and config["dataloader/batch_size"] == "16"
    assert "stepwatch" in record.tags and "succeeded" in record.tags
    summary: dict[str, Any] = {}
    for update in _records(offline, "summary"):
        for item in update.update:
            summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    final = json.loads((run / "final_summary.json").read_text())
    assert summary["summary/steps"] == final["overall"]["steps"]
    assert summary["verdict"] == final["diagnosis"]["primary"]["name"]
    (exit_record,) = _records(offline, "exit")
    assert exit_record.exit_code == 0


def test_the_summary_diagnosis_report_and_trace_are_run_files(offline: Path) -> None:
    named = {f.path for record in _records(offline, "files") for f in record.files}
    assert {"summary.json", "summary.txt", "diagnosis.json", "report.html", "trace.json"} <= named
    trace = json.loads((offline / "files" / "trace.json").read_text())
    assert {e["ph"] for e in trace["traceEvents"]} >= {"X", "M"}
