"""``INPUT_BOUND``'s evidence and next step name the DataLoader settings the program ran with,
read from the loader object during a real ``stepwatch run`` (capture/program_settings.py,
analysis/program_settings.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from .conftest import Run

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

# a Dataset that sleeps 3 ms an item, 16 items a batch, read by 2 worker processes
SLOW_DATASET = ("slow-dataset", "--steps", "60", "--forward-ms", "5", "--slow-item-ms", "3", "--workers", "2")
SLOW_LOADER = ("slow-loader", "--steps", "150", "--forward-ms", "20", "--slow-loader-ms", "15")  # test_verdict_runs'


def test_a_slow_dataset_read_by_two_workers_names_num_workers_and_the_cores(runs: Callable[..., Run]) -> None:
    run = runs(*SLOW_DATASET)
    primary = run.diagnosis["primary"]
    assert primary["name"] == "INPUT_BOUND", primary
    cores = len(os.sched_getaffinity(0))
    loader = primary["evidence"]["program"]["dataloader"]
    assert loader["num_workers"] == 2 and loader["pin_memory"] is False and loader["batch_size"] == 16
    assert loader["dataset"] == "Numbers" and loader["dataset_len"] == 60 * 16 and loader["usable_cpus"] == cores
    assert loader["sampler"] == "SequentialSampler" and loader["prefetch_factor"] == 2
    assert primary["next_step"].startswith(f"num_workers is 2 on a {cores}-core machine")
    assert "prefetch_factor is 2" in primary["next_step"]
    text = (run.out / "final_summary.txt").read_text()
    assert "settings DataLoader: num_workers 2, pin_memory False" in text and f"{cores} cores" in text
    assert run.explain()["diagnosis"]["primary"]["next_step"] == primary["next_step"]


def test_a_loader_without_workers_is_told_to_start_some(runs: Callable[..., Run]) -> None:
    primary = runs(*SLOW_LOADER).diagnosis["primary"]
    assert primary["name"] == "INPUT_BOUND"
    assert primary["next_step"].startswith("num_workers is 0 on a ")
    assert primary["evidence"]["program"]["dataloader"]["num_workers"] == 0
