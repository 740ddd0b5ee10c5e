"""The loss and the gradient norm with no code (capture/inferred_metrics.py): real runs of a
script with no stepwatch call under ``stepwatch run``, and in-process loops under
``stepwatch.init`` for what a run's history cannot tell apart."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import stepwatch
from stepwatch.artifacts.spool import read_spool
from stepwatch.capture.inferred_metrics import GRAD_NORM_SOURCE, LOSS_SOURCE
from stepwatch.guard import reset_swallowed, swallowed
from tests.support import STEPWATCH, clean_env
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

PROGRAM = Path(__file__).resolve().parent / "programs" / "loss_no_code.py"
STEPS, NAN_FROM = 30, 17
QUIET = {"interval": 60.0, "heartbeat_interval": 60.0}


def run(base: Path, name: str, nan_from: int) -> Path:
    out = base / name
    proc = subprocess.run([*STEPWATCH, "run", "--out", str(out), str(PROGRAM), str(STEPS), str(nan_from)], cwd=base,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return once(tmp_path_factory, "capture-inferred-loss", _runs)


def _runs(base: Path) -> dict[str, Path]:
    return {"nan": run(base, "nan", NAN_FROM), "clean": run(base, "clean", -1)}


def alerts(out: Path) -> list[dict[str, Any]]:
    path = out / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def series(out: Path, name: str) -> list[tuple[int, float | None, str | None, dict[str, Any]]]:
    """(step, value, non-finite text, attrs) of each ``name`` mark, by step."""
    with sqlite3.connect(out / "history.sqlite") as db:
        rows = db.execute(
            "SELECT s.idx, m.value_num, m.value_text, m.attrs FROM marks m JOIN spans s "
            "ON s.session_id = m.session_id AND s.span_id = m.span_id AND s.name = 'step' "
            "WHERE m.name = ? ORDER BY s.idx", (name,)).fetchall()
    return [(step, num, text, json.loads(attrs)) for step, num, text, attrs in rows]


def test_a_loss_turning_nan_raises_nonfinite_with_no_code(runs: dict[str, Path]) -> None:
    found = [a for a in alerts(runs["nan"]) if a["kind"] == "NONFINITE"]
    by_metric = {a["evidence"]["metric"]: a for a in found}
    assert set(by_metric) == {"loss", "grad_norm"}
    assert by_metric["loss"]["step"] == NAN_FROM and by_metric["loss"]["ranks"] == [0]
    assert "(inferred: backward root)" in by_metric["loss"]["message"]
    assert by_metric["loss"]["evidence"]["values"]["0"]["inferred"] == LOSS_SOURCE


def test_a_clean_run_raises_no_alert(runs: dict[str, Path]) -> None:
    assert alerts(runs["clean"]) == []


def test_the_loss_series_is_in_the_history_with_its_source_one_value_a_step(runs: dict[str, Path]) -> None:
    losses = series(runs["nan"], "loss")
    assert [step for step, *_ in losses] == list(range(STEPS))  # the penalty's autograd.grad is no loss
    assert all(attrs == {"source": LOSS_SOURCE, "inferred": True} for *_, attrs in losses)
    assert all(value is not None and value > 0 for _, value, _, _ in losses[:NAN_FROM])
    assert all(value is None and text == "nan" for _, value, text, _ in losses[NAN_FROM:])


def test_clip_grad_norms_value_is_recorded_each_step(runs: dict[str, Path]) -> None:
    norms = series(runs["clean"], "grad_norm")
    assert [step for step, *_ in norms] == list(range(STEPS))
    assert all(attrs["source"] == GRAD_NORM_SOURCE for *_, attrs in norms)
    assert all(value is not None and value > 0 for _, value, _, _ in norms)


# -- in process -----------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Any:
    reset_swallowed()
    stepwatch.init(out=tmp_path / "run", **QUIET)
    yield tmp_path / "run"
    stepwatch.shutdown()
    assert swallowed() == {}


def marks(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [m for m in read_spool(run_dir).marks if m["name"] == name]


def test_only_scalar_roots_are_losses(run_dir: Path) -> None:
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    out = model(x)
    torch.autograd.grad(out.sum(), x, retain_graph=True)  # a gradient penalty's call
    out.backward(torch.ones_like(out), retain_graph=True)  # a non-scalar root
    torch.autograd.backward([out.sum(), out.mean()], retain_graph=True)  # several roots at once
    (out.pow(2).mean()).backward()  # the loss
    stepwatch.shutdown()
    losses = marks(run_dir, "loss")
    assert len(losses) == 1 and losses[0]["value"] == pytest.approx(out.pow(2).mean().item())


def test_a_grad_scalers_scaled_loss_is_recorded_unscaled(run_dir: Path) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = model(torch.randn(4, 3)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    stepwatch.shutdown()
    (recorded,) = marks(run_dir, "loss")
    assert recorded["value"] == pytest.approx(loss.item())
    (norm,) = marks(run_dir, "grad_norm")
    assert norm["attrs"] == {"source": GRAD_NORM_SOURCE, "inferred": True, "scaler": True}


def test_a_user_loss_mark_stays_distinct_from_the_inferred_one(run_dir: Path) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        optimizer.step()
        stepwatch.mark("loss", loss)
    stepwatch.shutdown()
    losses = marks(run_dir, "loss")
    mine = [m for m in losses if not (m.get("attrs") or {}).get("inferred")]
    inferred = [m for m in losses if (m.get("attrs") or {}).get("inferred")]
    assert len(mine) == len(inferred) == 3
    assert [m["span_id"] for m in mine] == [m["span_id"] for m in inferred]  # the same steps
