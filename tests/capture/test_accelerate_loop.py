"""A real Hugging Face Accelerate loop with gradient accumulation under stepwatch (issue 20,
section 3): 96 batches over 2 epochs with ``gradient_accumulation_steps=4`` are exactly 24 steps
(one per optimizer update, each holding its 4 micro-batches) in exactly 2 epochs.

Accelerate's ``DataLoaderShard`` reads its ``DataLoader`` one batch ahead, so that loader is
exhausted before the pass's last batch is trained on: the last accumulation group must not be
split at the pass's end, nor its last micro-batch open an epoch of its own."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from stepwatch.artifacts.spool import read_spool
from tests.support import clean_env, needs
from tests.support.shared import once

# every test here starts a process or trains a model; accelerate is looked up, not imported, by
# each worker's collection (the program imports it)
pytestmark = [pytest.mark.real, needs("accelerate")]

PROGRAM = Path(__file__).resolve().parent / "programs" / "accelerate_accumulation.py"


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return once(tmp_path_factory, "capture-accelerate", _spans)


def _spans(base: Path) -> list[dict[str, Any]]:
    run_dir = base / "run"
    done = subprocess.run([sys.executable, str(PROGRAM), str(run_dir)], env=clean_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "UPDATES 24" in done.stdout, done.stdout + done.stderr
    return read_spool(run_dir).spans


def test_each_update_is_one_step_of_four_micro_batches(spans: list[dict[str, Any]]) -> None:
    steps = [s for s in spans if s["name"] == "step"]
    assert len(steps) == 24
    assert [s for s in spans if s["name"] == "eval_step"] == []
    for step in steps:
        kids = Counter(s["name"] for s in spans if s["parent_id"] == step["id"])
        assert (kids["forward"], kids["backward"], kids["optimizer_step"]) == (4, 4, 1), (step["index"], kids)
    assert sorted(s["index"] for s in steps) == list(range(24))


def test_each_pass_is_one_epoch_of_twelve_steps(spans: list[dict[str, Any]]) -> None:
    epochs = sorted((s for s in spans if s["name"] == "epoch"), key=lambda s: s["start_ns"])
    assert [e["index"] for e in epochs] == [0, 1]
    for epoch in epochs:
        inside = [s for s in spans if s["name"] == "step" and s["parent_id"] == epoch["id"]]
        assert len(inside) == 12
        assert all(epoch["start_ns"] <= s["start_ns"] and s["end_ns"] <= epoch["end_ns"] for s in inside)
