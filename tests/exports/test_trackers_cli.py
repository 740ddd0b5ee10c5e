"""What the three tracker exports share on the command line: a missing tracker package is one
``error:`` line naming the extra to install and exit code 2, with nothing written; and
``stepwatch run --export`` exports at the end of a (tiny, real) run, where a failed export is one
line and leaves the training's exit code alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from stepwatch.ui.cli import cli
from tests.support import ROOT, STEPWATCH, clean_env
from tests.support.shared import once
from tests.support.trace_run import trace_run

TINY = ROOT / "exports" / "programs" / "tiny_train.py"


@pytest.mark.parametrize(("tracker", "module", "args"), [
    ("tensorboard", "tensorboard", ["-o", "{out}"]),
    ("mlflow", "mlflow", ["--tracking-uri", "sqlite:///{out}/mlflow.db"]),
    ("wandb", "wandb", ["--dir", "{out}"]),
])
def test_a_missing_tracker_is_one_line_naming_its_extra_and_exit_2(
        tracker: str, module: str, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what Python's import does for a package not installed
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["export", tracker, str(tmp_path), *[a.format(out=out) for a in args]])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"pip install 'stepwatch[{tracker}]'" in lines[0]
    assert not out.exists() and result.stdout == ""


def test_a_damaged_store_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "history.sqlite").write_bytes(b"not a database" * 100)
    result = CliRunner().invoke(cli, ["export", "tensorboard", str(tmp_path), "-o", str(tmp_path / "tb")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "history.sqlite" in lines[0], result.stderr


@pytest.mark.real
def test_a_session_the_store_does_not_hold_is_one_error_line(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    run = trace_run(tmp_path_factory)
    other = "0" * 8 + "-0000-0000-0000-" + "0" * 12  # a session the store does not hold
    result = CliRunner().invoke(cli, ["export", "tensorboard", str(run), "--session", other, "-o", str(tmp_path)])
    assert result.exit_code == 2 and other in result.stderr


def _tiny(base: Path) -> tuple[Path, int, str, str]:
    out = base / "run"
    blocked = base / "blocked"  # a package named mlflow that cannot be imported: the extra is "missing"
    (blocked / "mlflow").mkdir(parents=True)
    (blocked / "mlflow" / "__init__.py").write_text("raise ImportError('mlflow is blocked for this test')\n")
    env = clean_env(PYTHONPATH=f"{blocked}:{clean_env().get('PYTHONPATH', '')}".rstrip(":"))
    proc = subprocess.run([*STEPWATCH, "run", "--quiet", "--view", "off", "--out", str(out), "--export", "tensorboard",
                           "--export", "mlflow", str(TINY)], cwd=base, env=env, capture_output=True, text=True,
                          timeout=120)
    return out, proc.returncode, proc.stdout, proc.stderr


@pytest.mark.real
def test_run_export_writes_at_the_end_and_a_failed_export_leaves_the_exit_code(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, code, _stdout, stderr = once(tmp_path_factory, "exports-tiny-run-export", _tiny)
    assert code == 3, stderr  # the training's own exit code
    failed = [line for line in stderr.splitlines() if "export mlflow failed" in line]
    assert len(failed) == 1 and "pip install 'stepwatch[mlflow]'" in failed[0], stderr
    assert f"tensorboard: {(out / 'tensorboard').resolve()}" in stderr
    acc = EventAccumulator(str(out / "tensorboard" / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("mark/loss")] == list(range(6))
    assert not (out / "mlflow.db").exists()


@pytest.mark.real
@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # MLflow 3.17 on SQLAlchemy 2.1
def test_a_failed_one_rank_run_is_a_failed_mlflow_run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("torch")
    from mlflow.tracking import MlflowClient

    out, code, _stdout, _stderr = once(tmp_path_factory, "exports-tiny-run-export", _tiny)
    assert code == 3
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = CliRunner().invoke(cli, ["export", "mlflow", str(out), "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    client = MlflowClient(tracking_uri=uri)
    got = client.get_run(result.stdout.split()[0])
    assert got.info.status == "FAILED" and got.data.tags["stepwatch.outcome"] == "failed"
    assert got.data.params["world_size"] == "1"
    losses = sorted(client.get_metric_history(got.info.run_id, "rank_0/mark/loss"), key=lambda m: m.step)
    assert [m.step for m in losses] == list(range(6))


@pytest.mark.real
def test_a_run_with_no_history_exports_from_its_artifacts_and_is_left_as_it_was(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"  # what `track` or `stepwatch.init` alone leaves: the artifacts, no history.sqlite
    shutil.copytree(trace_run(tmp_path_factory), run, ignore=shutil.ignore_patterns("history.sqlite*"))
    before = sorted(p.name for p in run.iterdir())
    result = CliRunner().invoke(cli, ["export", "tensorboard", str(run), "-o", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run.iterdir()) == before
    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / "tb" / f"rank_{rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        assert len(acc.Scalars("step_time_ms")) == len(acc.Scalars("mark/loss")) == 24


@pytest.mark.real
def test_a_tracking_server_that_does_not_answer_is_one_error_line(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("torch")
    from tests.support import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the test's own: one try (the export's default is 2)
    run = trace_run(tmp_path_factory)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(cli, ["export", "mlflow", str(run), "--tracking-uri", uri])
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: mlflow export failed: MlflowException"), result.stderr
