"""``stepwatch export tensorboard`` on the shared real two-rank run, exported twice: TensorBoard's
own reader (``EventAccumulator``) finds a run per rank with a point per recorded step for each
scalar (not two: the second export replaced the first's file), the values the history holds, and
the summary's figures and params beside them."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepwatch.exports.tensorboard import event_file_name
from stepwatch.ui.cli import cli
from tests.support.shared import once
from tests.support.trace_run import STEPS_PER_RANK

pytestmark = pytest.mark.real  # the run is a real stepwatch run (torchrun, two ranks)

pytest.importorskip("torch")
pytest.importorskip("tensorboard")


def _logdir(base: Path, run: Path) -> tuple[Path, list[tuple[str, int]]]:
    """The folder, exported twice (the second replaces the first's files), and the files the
    first export left (path, inode)."""
    out = base / "tb"
    first: list[tuple[str, int]] = []
    for _ in range(2):
        result = CliRunner().invoke(cli, ["export", "tensorboard", str(run), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == str(out)
        first = first or [(str(p.relative_to(out)), p.stat().st_ino) for p in sorted(out.rglob("*")) if p.is_file()]
    return out, first


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, int]]]:
    """The event files, written once for every worker."""
    return once(tmp_path_factory, "exports-tensorboard", lambda base: _logdir(base, run))


@pytest.fixture(scope="module")
def logdir(exported: tuple[Path, list[tuple[str, int]]]) -> Path:
    return exported[0]


def _read(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _rows(run: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        return db.execute(sql).fetchall()


def test_exporting_again_replaces_the_sessions_one_file_per_folder(run: Path, exported: Any) -> None:
    logdir, first = exported
    session = json.loads((run / "run.json").read_text())["session_id"]
    now = [(str(p.relative_to(logdir)), p.stat().st_ino) for p in sorted(logdir.rglob("*")) if p.is_file()]
    name = event_file_name(session)
    assert [path for path, _ in now] == [f"{folder}/{name}" for folder in ("rank_0", "rank_1", "summary")]
    assert [path for path, _ in first] == [path for path, _ in now]  # the same names, not a second file
    assert all(a != b for (_, a), (_, b) in zip(first, now, strict=True))  # new files, moved over the old


def test_a_run_per_rank_with_a_point_per_step_for_each_scalar(run: Path, logdir: Path) -> None:
    assert sorted(p.name for p in logdir.iterdir()) == ["rank_0", "rank_1", "summary"]
    for rank in (0, 1):
        acc = _read(logdir / f"rank_{rank}")
        tags = set(acc.Tags()["scalars"])
        assert {"step_time_ms", "steps_per_s", "memory/rss_bytes", "mark/loss", "mark/grad_norm",
                "phase_share/forward", "phase_share/backward", "phase_share/wait"} <= tags
        for tag in tags:
            assert [e.step for e in acc.Scalars(tag)] == list(range(STEPS_PER_RANK)), tag


def test_the_values_are_the_historys(run: Path, logdir: Path) -> None:
    acc = _read(logdir / "rank_1")
    steps = _rows(run, "SELECT step, step_ns, backward_ns, end_ns FROM steps WHERE rank = 1 ORDER BY step")
    times = acc.Scalars("step_time_ms")
    shares = acc.Scalars("phase_share/backward")
    for (step, step_ns, backward_ns, end_ns), time, share in zip(steps, times, shares, strict=True):
        assert time.step == step and time.value == pytest.approx(step_ns / 1e6, rel=1e-6)
        assert share.value == pytest.approx(backward_ns / step_ns, rel=1e-6)
        assert time.wall_time == pytest.approx(end_ns / 1e9)
    losses = [v for (v,) in _rows(run, "SELECT value_num FROM marks WHERE rank = 1 AND name = 'loss' "
                                       "AND attrs NOT LIKE '%inferred%' ORDER BY ts_ns")]
    assert [e.value for e in acc.Scalars("mark/loss")] == pytest.approx(losses, rel=1e-6)
    rates = acc.Scalars("steps_per_s")
    assert all(e.value > 0 for e in rates)
    assert all(e.value > 1e6 for e in acc.Scalars("memory/rss_bytes"))  # a Python process's RSS, in bytes


def test_the_summary_and_params_sit_beside_the_ranks(run: Path, logdir: Path) -> None:
    acc = _read(logdir / "summary")
    assert acc.Scalars("summary/steps")[0].value == 2 * STEPS_PER_RANK
    assert {"summary/step_ms_median", "summary/steps_per_s", "summary/phase_share/backward"} <= set(acc.Tags()["scalars"])
    table = acc.Tensors("params")[0].tensor_proto.string_val[0].decode()
    assert "| world_size | 2 |" in table and "| optimizer/class | SGD |" in table and "| dataloader/batch_size | 16 |" in table
