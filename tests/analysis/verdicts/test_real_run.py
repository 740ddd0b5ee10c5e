"""Verdicts on real torch training loops (CPU) recorded by stepwatch: the history is built from
the run's own artifacts, as ``stepwatch explain`` does for a run captured without an aggregator.
A loader made slow is INPUT_BOUND, a sleep after each step is BETWEEN_STEPS, tensors kept across
steps creep on the process RSS; a clean loop says nothing loud and does not creep."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import stepwatch  # noqa: E402
from stepwatch.analysis.verdicts import Diagnosis  # noqa: E402
from stepwatch.analysis.verdicts.inputs import diagnose_store  # noqa: E402
from stepwatch.guard import reset_swallowed, swallowed  # noqa: E402
from stepwatch.store import open_store  # noqa: E402
from stepwatch.store.importers import import_path  # noqa: E402


class SlowSamples(Dataset):  # type: ignore[type-arg]
    """A dataset whose every sample takes ``delay`` seconds to read (a slow disk, a decode)."""

    def __init__(self, count: int, delay: float) -> None:
        self.count, self.delay = count, delay
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(count, 64, generator=generator), torch.randn(count, 1, generator=generator)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[index], self.y[index]


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[Any]:
    """Train a loop under ``stepwatch.init``; give back the diagnosis of the recorded run."""
    reset_swallowed()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(loader: Any, model: nn.Module, *, sleep: float = 0.0, leak_mib: int = 0, interval: float = 1.0) -> Diagnosis:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run_dir = tmp_path / "run"
        kept = []
        stepwatch.init(out=run_dir, handle_signals=False, capture_oom=False, interval=interval)
        try:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if leak_mib:
                    kept.append(torch.ones(leak_mib << 18))  # written, so resident: leak_mib MiB a step
                if sleep:
                    time.sleep(sleep)
        finally:
            stepwatch.shutdown()
        store = open_store(tmp_path / "history.sqlite")
        try:
            import_path(run_dir, store)
            session = store.sessions()[0]["session_id"]
            return diagnose_store(store, session)
        finally:
            store.close()

    try:
        yield run
    finally:
        torch.set_num_threads(threads)
    assert swallowed() == {}


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))


def wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))


def loud(diagnosis: Diagnosis) -> list[str]:
    return [f"{v.name} {v.severity}: {v.message}" for v in diagnosis.all() if v.severity != "info"]


def test_a_slow_loader_is_input_bound(recorded: Any) -> None:
    diagnosis = recorded(DataLoader(SlowSamples(4 * 60, 0.001), batch_size=4), small())
    primary = diagnosis.primary
    assert primary.name == "INPUT_BOUND", diagnosis.to_dict()
    assert primary.severity == "crit" and primary.ranks == (0,)
    assert primary.evidence["window"]["steps"] >= 50
    assert primary.evidence["mean_ms"] >= 3.0  # four samples of 1 ms each
    # the fetch counted once: not also as time outside every phase (on a loaded machine the
    # residual may still be heavy on its own, so its share is compared with the fetch's)
    shares = primary.evidence["shares"]
    assert shares["residual"] < shares["input"] / 2, shares


def test_a_sleep_after_each_step_is_time_between_steps(recorded: Any) -> None:
    batches = [(torch.randn(256, 64), torch.randn(256, 1)) for _ in range(40)]
    diagnosis = recorded(DataLoader(batches, batch_size=None), wide(), sleep=0.02)
    between = next(v for v in diagnosis.step_time if v.name == "BETWEEN_STEPS")
    assert between.severity == "crit", diagnosis.to_dict()
    assert between.evidence["between_ms_per_step"] >= 19.0


def test_a_clean_loop_says_nothing_loud(recorded: Any) -> None:
    batches = [(torch.randn(256, 64), torch.randn(256, 1)) for _ in range(60)]
    diagnosis = recorded(DataLoader(batches, batch_size=None), wide())
    assert loud(diagnosis) == [], diagnosis.to_dict()
    assert diagnosis.primary.name in ("COMPUTE_BOUND", "BALANCED")


def test_a_cpu_loop_that_keeps_tensors_creeps_on_its_rss(recorded: Any) -> None:
    batches = [(torch.randn(32, 64), torch.randn(32, 1)) for _ in range(150)]
    diagnosis = recorded(DataLoader(batches, batch_size=None), small(), sleep=0.005, leak_mib=1, interval=0.02)
    creep = [v for v in diagnosis.memory if v.name.startswith("CREEP")]
    assert [v.name for v in creep] == ["CREEP_EARLY"], diagnosis.to_dict()
    assert creep[0].ranks == (0,) and creep[0].evidence["memory"] == "rss"
    assert creep[0].evidence["delta_gib"] >= 0.08  # about three quarters of the 150 MiB kept


def test_the_same_loop_without_the_leak_does_not_creep(recorded: Any) -> None:
    batches = [(torch.randn(32, 64), torch.randn(32, 1)) for _ in range(150)]
    diagnosis = recorded(DataLoader(batches, batch_size=None), small(), sleep=0.005, interval=0.02)
    assert not [v for v in diagnosis.memory if v.name.startswith("CREEP")], diagnosis.to_dict()
