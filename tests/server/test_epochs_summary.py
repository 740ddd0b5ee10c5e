"""Epochs in the final summary (text and JSON), ``stepwatch summary`` and ``stepwatch inspect``:
a real loop of 3 epochs, each 10 training steps and an evaluation of 3 forward-only batches;
and a loop with no stepwatch code that evaluates after each pass over its training loader."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support import STEPWATCH, clean_env, examples
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

LOOP = """
import time, torch
import stepwatch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
train = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 2)), batch_size=4)
val = DataLoader(TensorDataset(torch.randn(12, 8), torch.randn(12, 2)), batch_size=4)
for epoch in stepwatch.epochs(3):
    model.train()
    for x, y in train:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for x, y in val:
            model(x)
            time.sleep(0.01)
"""


def _train(base: Path, code: str) -> Path:
    """``stepwatch run`` of ``code`` in ``base``; its run directory."""
    pytest.importorskip("torch")
    script = base / "loop.py"
    script.write_text(code)
    out = base / "run"
    proc = subprocess.run(check=False, args=[*STEPWATCH, "run", "--out", str(out), str(script)], cwd=base,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once(tmp_path_factory, "epochs", lambda base: _train(base, LOOP))


# No stepwatch code: the epochs are the passes over the training loader, each ended when the loader
# is exhausted, and the evaluation follows it (minGPT's trainer does this).
LOOP_EVAL_AFTER = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
train = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 2)), batch_size=4)
val = DataLoader(TensorDataset(torch.randn(12, 8), torch.randn(12, 2)), batch_size=4)
for epoch in range(3):
    model.train()
    for x, y in train:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for x, y in val:
            model(x)
            time.sleep(0.01)
    time.sleep(0.05)  # between the evaluation and the next epoch: no one's evaluation
"""


@pytest.fixture(scope="module")
def eval_after_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once(tmp_path_factory, "epochs-eval-after", lambda base: _train(base, LOOP_EVAL_AFTER))


def test_evaluation_after_each_epoch_is_that_epochs(eval_after_run: Path) -> None:
    epochs = json.loads((eval_after_run / "final_summary.json").read_text())["epochs"]
    assert epochs["count"] == 3 and epochs["steps_per_epoch"] == {"median": 10, "min": 10, "max": 10}
    listed = epochs["epochs"]
    assert [e["eval_steps"] for e in listed] == [3, 3, 3]
    for i, epoch in enumerate(listed):
        assert epoch["eval_ms"] >= 30 and epoch["eval_after_ms"] == epoch["eval_ms"]  # three 10 ms batches, after it
        if i + 1 < len(listed):  # ended before the next epoch: the 50 ms pause is no one's evaluation
            gap_ms = (listed[i + 1]["start_ns"] - epoch["start_ns"]) / 1e6 - epoch["duration_ms"]
            assert epoch["eval_ms"] <= gap_ms - 40
    total = epochs["eval_ms"]["total"]
    assert total == epochs["eval_ms"]["after_epochs"] == pytest.approx(sum(e["eval_ms"] for e in listed), abs=0.01)
    assert total >= 90
    assert epochs["eval_ms"]["share"] == pytest.approx(total / (epochs["duration_ms"]["total"] + total), abs=1e-3)
    line = next(line for line in (eval_after_run / "final_summary.txt").read_text().splitlines()
                if line.startswith("epochs "))
    assert "eval none" not in line and " eval " in line and "% of epoch time" in line


def _check(epochs: dict[str, Any]) -> None:
    assert epochs["count"] == 3
    assert epochs["steps_per_epoch"] == {"median": 10, "min": 10, "max": 10}
    assert [e["eval_steps"] for e in epochs["epochs"]] == [3, 3, 3]
    assert all(e["eval_ms"] >= 30 for e in epochs["epochs"])  # three 10 ms batches each
    assert epochs["duration_ms"]["total"] >= epochs["eval_ms"]["total"] > 90
    assert epochs["duration_ms"]["median"] > 0 and epochs["duration_ms"]["mean"] > 0


def test_the_final_summary_gives_epochs(epoch_run: Path) -> None:
    _check(json.loads((epoch_run / "final_summary.json").read_text())["epochs"])
    text = (epoch_run / "final_summary.txt").read_text()
    line = next(line for line in text.splitlines() if line.startswith("epochs "))
    assert line.startswith("epochs 3  duration median") and "steps/epoch 10" in line and "eval " in line


def test_summary_and_inspect_give_epochs(epoch_run: Path) -> None:
    summary = subprocess.run(check=False, args=[*STEPWATCH, "summary", str(epoch_run / "history.sqlite"), "--json"], env=clean_env(),
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    _check(json.loads(summary.stdout)["epochs"])
    inspect = subprocess.run(check=False, args=[*STEPWATCH, "inspect", str(epoch_run), "--json"], env=clean_env(),
                             capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stderr
    _check(json.loads(inspect.stdout)["epochs"])
    text = subprocess.run(check=False, args=[*STEPWATCH, "inspect", str(epoch_run)], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert "epochs 3  duration median" in text.stdout


_span = st.fixed_dictionaries({
    "rank": st.integers(0, 3), "name": st.sampled_from(["epoch", "step", "eval_step", "forward"]),
    "idx": st.one_of(st.none(), st.integers(0, 10)),
    "start_ns": st.one_of(st.none(), st.integers(0, 10**6)), "end_ns": st.one_of(st.none(), st.integers(0, 2 * 10**6)),
})


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(_span, max_size=60))
@example([{"rank": 0, "name": "epoch", "idx": None, "start_ns": 0, "end_ns": 0},
          {"rank": 0, "name": "epoch", "idx": 0, "start_ns": 0, "end_ns": 0}])
def test_epoch_report_takes_any_spans(spans: list[dict[str, Any]]) -> None:
    from stepwatch.analysis.epochs import epoch_report, render_epoch_line

    report = epoch_report(spans)
    valid = [s for s in spans if s["name"] == "epoch" and s["start_ns"] is not None and s["end_ns"] is not None
             and s["end_ns"] >= s["start_ns"]]
    if not valid:
        assert report is None and render_epoch_line(report) is None
        return
    assert report is not None
    per_rank = {r: sum(1 for s in valid if s["rank"] == r) for r in {s["rank"] for s in valid}}
    assert report["count"] == max(per_rank.values())
    assert sum(e["steps"] for e in report["epochs"]) <= sum(1 for s in spans if s["name"] == "step")
    # evaluation inside an epoch is within its time; what follows it is counted apart
    assert all(e["eval_ms"] <= e["duration_ms"] + e["eval_after_ms"] + 1e-6 for e in report["epochs"])
    assert report["eval_ms"]["share"] is None or 0 <= report["eval_ms"]["share"] <= 1
    assert isinstance(render_epoch_line(report), str)
