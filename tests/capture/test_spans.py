"""The span tree the training API and the torch patches write (spool-format-v1.md "Canonical
scope shape"): session > epoch[n] > step[n] > data_load, forward, backward, optimizer_step.

Every test trains a real (tiny) torch model on CPU between ``stepwatch.init`` and
``stepwatch.shutdown`` and reads the spool back; the autouse fixture shuts down even when a test
fails (the runtime patches torch globally) and fails any test in which stepwatch swallowed an
internal error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import stepwatch
from stepwatch.artifacts.spool import LoadedSpool, read_spool
from tests.support.capture import finish, start
from tests.support.marks import own_marks

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("training_test")]

HEX32 = re.compile(r"[0-9a-f]{32}")
PHASES = ("data_load", "forward", "backward", "optimizer_step")
SESSION = "stepwatch.session"


def make_training(seed: int = 0, samples: int = 30,
                  batch_size: int = 8) -> tuple[nn.Module, Any, DataLoader, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(samples, 4), torch.randn(samples, 1))
    return model, optimizer, DataLoader(data, batch_size=batch_size), nn.MSELoss()


def train_step(model: nn.Module, optimizer: Any, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def children(spool: LoadedSpool) -> dict[str | None, list[dict[str, Any]]]:
    tree: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spool.spans:
        tree[span["parent_id"]].append(span)
    return tree


def named(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spool.spans if s["name"] == name), key=lambda s: s["start_ns"])


def duration(span: dict[str, Any]) -> int:
    return span["end_ns"] - span["start_ns"]


def session_of(spool: LoadedSpool) -> dict[str, Any]:
    sessions = named(spool, SESSION)
    assert len(sessions) == 1
    return sessions[0]


def assert_canonical(spool: LoadedSpool, *, epochs: int, steps_per_epoch: int) -> None:
    """session > epoch[n] > step[n] > one each of data_load, forward, backward, optimizer_step."""
    tree = children(spool)
    session = session_of(spool)
    assert session["parent_id"] is None
    epoch_spans = named(spool, "epoch")
    assert [e["index"] for e in epoch_spans] == list(range(epochs))
    assert all(e["parent_id"] == session["id"] for e in epoch_spans)  # siblings, never nested
    for before, after in zip(epoch_spans, epoch_spans[1:]):
        assert before["end_ns"] <= after["start_ns"]
    step_index = 0
    for epoch in epoch_spans:
        assert "unclosed" not in epoch["attrs"]
        steps = sorted((s for s in tree[epoch["id"]] if s["name"] == "step"), key=lambda s: s["start_ns"])
        assert [s["index"] for s in steps] == list(range(step_index, step_index + steps_per_epoch))
        step_index += steps_per_epoch
        for step in steps:
            assert epoch["start_ns"] <= step["start_ns"] <= step["end_ns"] <= epoch["end_ns"]
            kids = tree[step["id"]]
            assert Counter(k["name"] for k in kids) == Counter(PHASES), step
            for kid in kids:
                assert step["start_ns"] <= kid["start_ns"] <= kid["end_ns"] <= step["end_ns"]
                assert tree[kid["id"]] == []  # the model's submodules and the loss are not spans
    assert len(named(spool, "step")) == epochs * steps_per_epoch


# -- the canonical tree --------------------------------------------------------------------


def test_epochs_and_trace_step_build_the_canonical_tree(tmp_path: Path) -> None:
    model, optimizer, loader, loss_fn = make_training()
    start(tmp_path)
    with torch.no_grad():
        model(torch.randn(2, 4))  # warm-up before the loop: no epoch exists yet
    for _ in stepwatch.epochs(2):
        for x, y in loader:  # 30 samples in batches of 8: the last batch is partial
            with stepwatch.trace_step(model):
                train_step(model, optimizer, loss_fn, x, y)
    spool = finish(tmp_path)

    assert_canonical(spool, epochs=2, steps_per_epoch=4)
    session = session_of(spool)
    forwards = named(spool, "forward")
    assert len(forwards) == 2 * 4 + 1
    warmup = forwards[0]
    # spool-format-v1.md: pre-loop work hangs under the session; a forward-only iteration is an
    # eval_step (docs/step-inference.md), so the warm-up is one, under the session
    (evaluation,) = named(spool, "eval_step")
    assert warmup["parent_id"] == evaluation["id"] and evaluation["parent_id"] == session["id"]
    assert warmup["end_ns"] <= named(spool, "epoch")[0]["start_ns"]


@pytest.mark.parametrize("source", ["dataloader", "list"])
def test_batches_builds_the_same_tree(tmp_path: Path, source: str) -> None:
    model, optimizer, loader, loss_fn = make_training()
    iterable = loader if source == "dataloader" else list(loader)  # a plain list: batches() times the fetch
    start(tmp_path)
    for _ in stepwatch.epochs(2):
        for x, y in stepwatch.batches(iterable, model):
            train_step(model, optimizer, loss_fn, x, y)
    spool = finish(tmp_path)

    assert_canonical(spool, epochs=2, steps_per_epoch=4)
    for step in named(spool, "step"):
        (load,) = [s for s in children(spool)[step["id"]] if s["name"] == "data_load"]
        assert load["start_ns"] == step["start_ns"]  # the step starts at its batch's fetch


def test_ids_clock_and_process_fields(tmp_path: Path) -> None:
    model, optimizer, loader, loss_fn = make_training()
    before = time.time_ns()
    start(tmp_path)
    for _ in stepwatch.epochs(1):
        for x, y in loader:
            with stepwatch.trace_step(model):
                train_step(model, optimizer, loss_fn, x, y)
                stepwatch.mark("loss", 1.0)
    spool = finish(tmp_path)
    after = time.time_ns()

    ids = [s["id"] for s in spool.spans] + [m["id"] for m in spool.marks]
    assert all(HEX32.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    by_id = spool.span_by_id()
    for span in spool.spans:
        assert before <= span["start_ns"] <= span["end_ns"] <= after  # wall clock, ns since the epoch
        assert span["parent_id"] is None or span["parent_id"] in by_id
        assert span["pid"] == os.getpid()
        assert span["rank"] == 0
        assert span["thread_id"] == threading.get_ident()
        assert span["cpu_ns"] is None and span["gpu_ns"] is None and span["memory_peak_bytes"] is None


# -- the step's phase breakdown ------------------------------------------------------------


class _SlowData(Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 4), torch.randn(n, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.001)
        return self.x[i], self.y[i]


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.006)
        return grad


class _SlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return _SlowBackward.apply(self.layer(x))


class _SlowSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        time.sleep(0.003)
        return super().step(closure)


def assert_breakdown(spool: LoadedSpool, step: dict[str, Any]) -> None:
    attrs = step["attrs"]
    kids = children(spool)[step["id"]]
    times = {name: sum(duration(k) for k in kids if k["name"] == name) for name in (*PHASES, "h2d")}
    assert attrs["step_ns"] == duration(step)
    for name, total in times.items():
        assert attrs[f"{name}_ns"] == total, name
    busy = times["h2d"] + times["forward"] + times["backward"] + times["optimizer_step"]
    assert attrs["wait_ns"] == max(0, attrs["step_ns"] - busy)  # aggregator-architecture.md
    assert sum(times.values()) <= attrs["step_ns"]


def test_step_phase_times_equal_children_and_add_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _SlowModel()
    optimizer = _SlowSGD(model.parameters(), lr=0.01)
    loader = DataLoader(_SlowData(10), batch_size=4)  # 4 + 4 + 2: the last step is partial
    loss_fn = nn.MSELoss()
    start(tmp_path)
    for _ in stepwatch.epochs(2):
        for x, y in loader:
            with stepwatch.trace_step(model):
                train_step(model, optimizer, loss_fn, x, y)
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 6
    for step in steps:
        assert_breakdown(spool, step)
        attrs = step["attrs"]
        assert attrs["forward_ns"] >= 5_000_000 and attrs["backward_ns"] >= 6_000_000
        assert attrs["optimizer_step_ns"] >= 3_000_000 and attrs["data_load_ns"] >= 2_000_000
        phases = sum(attrs[f"{name}_ns"] for name in PHASES)
        assert phases >= 0.75 * attrs["step_ns"], attrs  # little of the step is unattributed
        assert attrs["wait_ns"] >= attrs["data_load_ns"]  # the fetch is part of the residual


def test_fetch_before_trace_step_is_adopted_exactly_once(tmp_path: Path) -> None:
    model, optimizer, loader, loss_fn = make_training(samples=40)
    start(tmp_path)
    for _ in stepwatch.epochs(2):
        for x, y in loader:  # fetched before trace_step opens
            with stepwatch.trace_step(model):
                train_step(model, optimizer, loss_fn, x, y)
    spool = finish(tmp_path)

    loads = named(spool, "data_load")
    steps = named(spool, "step")
    by_id = spool.span_by_id()
    assert len(loads) == len(steps) == 10
    assert all(by_id[load["parent_id"]]["name"] == "step" for load in loads)  # none outside a step
    assert sum(duration(load) for load in loads) == sum(s["attrs"]["data_load_ns"] for s in steps)
    for step in steps:
        assert_breakdown(spool, step)


def test_partial_final_step_keeps_its_breakdown(tmp_path: Path) -> None:
    """Inferred steps (no trace_step) of a train and an eval loop per epoch: the last, partial
    batch of each loop closes as a step with its breakdown, inside its epoch, and does not
    absorb the time after the loader is exhausted."""
    model, optimizer, loader, loss_fn = make_training(samples=20)  # 8 + 8 + 4
    start(tmp_path)
    for _ in stepwatch.epochs(2):
        for x, y in loader:
            train_step(model, optimizer, loss_fn, x, y)
        with torch.no_grad():
            for x, _y in loader:
                model(x)
        time.sleep(0.15)  # after the last batch: not part of any step
    spool = finish(tmp_path)

    epochs = named(spool, "epoch")
    assert all("unclosed" not in e["attrs"] for e in epochs)
    by_id = spool.span_by_id()
    for name in ("step", "eval_step"):
        steps = named(spool, name)
        assert [s["index"] for s in steps] == list(range(6))
        assert sorted(by_id[s["parent_id"]]["index"] for s in steps) == [0, 0, 0, 1, 1, 1]
        for step in steps:
            assert "unclosed" not in step["attrs"]
            assert_breakdown(spool, step)
            assert step["attrs"]["step_ns"] < 100_000_000, step  # the sleep is not in it
    for step in named(spool, "eval_step"):
        assert step["attrs"]["backward_ns"] == step["attrs"]["optimizer_step_ns"] == 0


@pytest.mark.parametrize("how", ["trace_step(model)", "trace_step()", "inferred"])
def test_loss_module_is_not_a_second_forward(tmp_path: Path, how: str) -> None:
    model, optimizer, loader, _ = make_training()
    losses = [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss()]
    start(tmp_path)
    for x, y in loader:
        with stepwatch.trace_step(model) if how == "trace_step(model)" else (
                stepwatch.trace_step() if how == "trace_step()" else contextlib.nullcontext()):
            out = model(x)
            loss = sum(fn(out, y) for fn in losses)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 4
    for step in steps:
        assert [k["name"] for k in children(spool)[step["id"]]].count("forward") == 1
    assert len(named(spool, "forward")) == 4


def test_short_run_has_every_span_kind(tmp_path: Path) -> None:
    """A run of about a second (shorter than the default spool interval), in a fresh
    interpreter that starts stepwatch before it imports torch."""
    script = textwrap.dedent(
        """
        import sys, time
        import stepwatch
        stepwatch.init(out=sys.argv[1])
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
        deadline = time.monotonic() + 1.0
        for _ in stepwatch.epochs(1000):
            for x, y in loader:
                with stepwatch.trace_step(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward(); optimizer.step(); optimizer.zero_grad()
                    stepwatch.mark("loss", loss)
                time.sleep(0.01)
            if time.monotonic() > deadline:
                break
        stepwatch.shutdown()
        """
    )
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script, str(run_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr
    spool = read_spool(run_dir)
    kinds = Counter(s["name"] for s in spool.spans)
    assert set(kinds) == {SESSION, "epoch", "step", *PHASES}, kinds
    assert kinds["step"] == kinds["forward"] == kinds["backward"] == kinds["optimizer_step"] == kinds["data_load"]
    assert len(own_marks(spool)) == kinds["step"]


# -- bounds and threads ----------------------------------------------------------------------


def _stop_event(run_dir: Path) -> dict[str, Any]:
    events = [json.loads(line) for path in sorted((run_dir / "telemetry").rglob("*.jsonl"))
              for line in path.read_text().splitlines() if line.strip()]
    (stop,) = [e for e in events if e["event_type"] == "stop"]
    return stop


def test_depth_cap_drops_and_counts_deeper_scopes(tmp_path: Path) -> None:
    start(tmp_path)
    depth = 70
    scopes = [stepwatch.scope(f"level{i}") for i in range(depth)]
    for scope in scopes:
        scope.__enter__()
    stepwatch.mark("deepest", 1)
    for scope in reversed(scopes):
        scope.__exit__(None, None, None)
    with stepwatch.scope("after"):
        pass
    spool = finish(tmp_path)

    levels = [s for s in spool.spans if s["name"].startswith("level")]
    assert sorted(s["name"] for s in levels) == sorted(f"level{i}" for i in range(64))
    by_id = spool.span_by_id()
    deepest = next(s for s in levels if s["name"] == "level63")
    chain = 0
    span = deepest
    while span["parent_id"] is not None:
        span = by_id[span["parent_id"]]
        chain += 1
    assert chain == 64 and span["name"] == SESSION
    (mark,) = spool.marks
    assert mark["span_id"] == deepest["id"]  # the innermost scope that was kept
    after = named(spool, "after")[0]
    assert after["parent_id"] == session_of(spool)["id"]  # the stack unwound correctly
    assert all("unclosed" not in s["attrs"] for s in spool.spans)
    assert _stop_event(tmp_path)["metadata"]["dropped"]["spans_over_depth_cap"] == depth - 64


def test_spans_from_a_short_lived_thread_are_spooled(tmp_path: Path) -> None:
    start(tmp_path)
    idents: list[int] = []

    def work() -> None:
        idents.append(threading.get_ident())
        with stepwatch.scope("worker", n=1):
            with stepwatch.scope("inner"):
                stepwatch.mark("in_thread", True)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    spool = finish(tmp_path)

    (worker,) = named(spool, "worker")
    (inner,) = named(spool, "inner")
    assert worker["thread_id"] == inner["thread_id"] == idents[0] != threading.get_ident()
    assert worker["parent_id"] == session_of(spool)["id"] and inner["parent_id"] == worker["id"]
    assert worker["attrs"] == {"n": 1}
    (mark,) = spool.marks
    assert mark["span_id"] == inner["id"] and inner["mark_ids"] == [mark["id"]]


def test_scopes_left_open_by_exited_threads_close_at_shutdown(tmp_path: Path) -> None:
    """Threads that exit with a scope open, one after another (so their thread ids are
    usually reused): every scope they left is closed at shutdown, flagged ``unclosed``."""
    start(tmp_path)

    def leave_open(i: int) -> None:
        stepwatch.scope(f"leak{i}").__enter__()
        with stepwatch.scope(f"closed{i}"):
            pass

    for i in range(5):
        thread = threading.Thread(target=leave_open, args=(i,))
        thread.start()
        thread.join()
    before_shutdown = time.time_ns()
    spool = finish(tmp_path)

    for i in range(5):
        (leak,) = named(spool, f"leak{i}")
        assert leak["attrs"] == {"unclosed": True}
        assert leak["end_ns"] >= before_shutdown
        (closed,) = named(spool, f"closed{i}")
        assert closed["parent_id"] == leak["id"] and "unclosed" not in closed["attrs"]


def test_scope_closed_on_another_thread_is_written_once(tmp_path: Path) -> None:
    start(tmp_path)
    handoff: list[Any] = []

    def opener() -> None:
        scope = stepwatch.scope("handed_over")
        scope.__enter__()
        handoff.append(scope)

    thread = threading.Thread(target=opener)
    thread.start()
    thread.join()
    handoff[0].__exit__(None, None, None)  # closed here, still on the dead thread's stack
    stepwatch.shutdown()

    raw = [span for path in sorted((tmp_path / "spool").glob("*.json"))
           for span in json.loads(path.read_text())["spans"] if span["name"] == "handed_over"]
    assert len(raw) == 1
    assert "unclosed" not in raw[0]["attrs"]


def test_span_buffer_stays_bounded_and_counts_evictions(tmp_path: Path) -> None:
    """The training thread's span table never grows past ``table_rows``;
    what it evicts (oldest first) is counted in the stop event."""
    runtime = start(tmp_path, table_rows=16, spool_interval=3600)  # no seal before shutdown
    for i in range(100):
        with stepwatch.scope("tick", i=i):
            pass
        assert len(runtime.spans.closed) <= 16
    spool = finish(tmp_path)

    ticks = named(spool, "tick")
    assert [s["attrs"]["i"] for s in ticks] == list(range(85, 100))  # the newest 15, plus the session
    assert len(spool.spans) == 16 and session_of(spool)
    assert _stop_event(tmp_path)["metadata"]["dropped"]["span_rows_evicted"] == 100 + 1 - 16
