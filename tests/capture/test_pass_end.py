"""Where a DataLoader pass's end applies (capture/training.py, ``end_pass``): at the next event,
so that a loader reading ahead keeps its last batch in the pass (test_accelerate_loop.py), and no
later: a phase that begins once the pass's last step is over is outside the pass's epoch.

Real tiny torch loops on CPU under ``stepwatch.init``; the spool is read back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch import guard
from stepwatch.artifacts.spool import read_spool


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    guard.reset_swallowed()
    yield
    stepwatch.shutdown()
    assert guard.swallowed() == {}, guard.recent_swallowed()


def _spans(run_dir: Path, evaluate_with_loader: bool) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train = DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=8)
    held_out = torch.randn(16, 4)
    stepwatch.init(out=run_dir, handle_signals=False, capture_oom=False)
    for _ in range(2):
        for x, y in train:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # evaluation after the pass, from tensors or a loader of its own
            batches = DataLoader(TensorDataset(held_out), batch_size=8) if evaluate_with_loader else [(held_out[:8],),
                                                                                                     (held_out[8:],)]
            for (x,) in batches:
                model(x)
    stepwatch.shutdown()
    return read_spool(run_dir).spans


@pytest.mark.parametrize("evaluate_with_loader", [False, True])
def test_work_after_the_last_step_of_a_pass_is_outside_its_epoch(tmp_path: Path, evaluate_with_loader: bool) -> None:
    spans = _spans(tmp_path, evaluate_with_loader)
    epochs = {s["id"]: s for s in spans if s["name"] == "epoch"}
    assert len(epochs) == 2
    steps = [s for s in spans if s["name"] == "step"]
    assert len(steps) == 6 and all(s["parent_id"] in epochs for s in steps)
    for span in spans:  # whatever an epoch holds lies inside its time
        epoch = epochs.get(span["parent_id"])
        if epoch is not None:
            assert epoch["start_ns"] <= span["start_ns"] and span["end_ns"] <= epoch["end_ns"], span["name"]
    evals = [s for s in spans if s["name"] == "eval_step"]
    assert len(evals) >= 2 and not any(s["parent_id"] in epochs for s in evals)
