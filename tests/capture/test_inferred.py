"""Plain torch loops with no ``trace_step`` and no ``stepwatch.epochs()``: the steps and epochs
stepwatch infers (spool-format-v1.md canonical shape; spool-current-practice.md mistakes not to
repeat). Real tiny torch training loops on CPU; the spool is read back."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch.artifacts.spool import LoadedSpool, read_spool
from tests.support.capture import finish, start
from tests.support.marks import own_marks

from .test_torch_patches import _FakeDeviceCopy

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("training_test")]

SESSION = "stepwatch.session"


def named(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spool.spans if s["name"] == name), key=lambda s: s["start_ns"])


def kids(spool: LoadedSpool) -> dict[str, list[dict[str, Any]]]:
    tree: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spool.spans:
        tree[span["parent_id"]].append(span)
    return tree


def setup(samples: int = 24) -> tuple[nn.Module, Any, DataLoader, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(samples, 4), torch.randn(samples, 1))
    return model, optimizer, DataLoader(data, batch_size=8), DataLoader(data, batch_size=12)


def train_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("traced", [False, True])
def test_passes_over_the_training_loader_are_epochs(tmp_path: Path, traced: bool) -> None:
    model, optimizer, train, evaluate = setup()
    start(tmp_path)
    for _ in range(3):
        for x, y in train:  # 3 batches a pass
            if traced:
                with stepwatch.trace_step(model):
                    train_step(model, optimizer, x, y)
            else:
                train_step(model, optimizer, x, y)
        with torch.no_grad():  # evaluation: a forward-only pass over another loader
            for x, _y in evaluate:
                model(x)
    spool = finish(tmp_path)

    session = named(spool, SESSION)[0]
    epochs = named(spool, "epoch")
    assert [e["index"] for e in epochs] == [0, 1, 2]
    assert all(e["parent_id"] == session["id"] and "unclosed" not in e["attrs"] for e in epochs)
    tree = kids(spool)
    steps = named(spool, "step")
    assert [s["index"] for s in steps] == list(range(9))
    for number, epoch in enumerate(epochs):
        mine = sorted((s for s in tree[epoch["id"]] if s["name"] == "step"), key=lambda s: s["start_ns"])
        assert [s["index"] for s in mine] == [3 * number, 3 * number + 1, 3 * number + 2]
        assert all(epoch["start_ns"] <= s["start_ns"] <= s["end_ns"] <= epoch["end_ns"] for s in mine)
    for before, after in zip(epochs, epochs[1:]):
        assert before["end_ns"] <= after["start_ns"]
    # the evaluation passes open no epoch: they run after the training pass is exhausted
    forwards = [f for f in named(spool, "forward") if spool.span_by_id()[f["parent_id"]]["name"] != "step"]
    assert forwards and all(not any(e["start_ns"] <= f["start_ns"] <= e["end_ns"] for e in epochs) for f in forwards)


def test_eval_loader_alone_opens_no_epoch(tmp_path: Path) -> None:
    model, _optimizer, _train, evaluate = setup()
    start(tmp_path)
    with torch.no_grad():
        for _ in range(2):
            for x, _y in evaluate:
                model(x)
    spool = finish(tmp_path)

    assert named(spool, "epoch") == [] and named(spool, "step") == []
    assert len(named(spool, "eval_step")) == 4


def test_marks_after_optimizer_step_land_on_the_inferred_step(tmp_path: Path) -> None:
    model, optimizer, train, _ = setup()
    start(tmp_path)
    for _ in range(2):
        for x, y in train:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            stepwatch.mark("loss", loss)  # after optimizer.step(): the step is still the place
            optimizer.zero_grad()
            time.sleep(0.002)
    spool = finish(tmp_path)

    steps = named(spool, "step")
    losses = [m for m in own_marks(spool) if m["name"] == "loss"]
    assert len(steps) == len(losses) == 6
    by_id = spool.span_by_id()
    tree = kids(spool)
    for mark in losses:
        step = by_id[mark["span_id"]]
        assert step["name"] == "step" and mark["id"] in step["mark_ids"]
        (opt,) = [k for k in tree[step["id"]] if k["name"] == "optimizer_step"]
        assert step["end_ns"] == opt["end_ns"] <= mark["ts_ns"]  # its end stays at the optimizer's
        assert step["attrs"]["step_ns"] == step["end_ns"] - step["start_ns"]


def test_loop_without_a_dataloader_gets_optimizer_driven_steps(tmp_path: Path) -> None:
    model, optimizer, _train, _ = setup()
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(5)]
    start(tmp_path)
    with torch.no_grad():
        model(torch.randn(2, 4))  # a warm-up forward: not part of step 0
    for x, y in batches:
        train_step(model, optimizer, x, y)
        stepwatch.mark("loss", 1.0)
    spool = finish(tmp_path)

    session = named(spool, SESSION)[0]
    steps = named(spool, "step")
    assert [s["index"] for s in steps] == list(range(5))
    tree = kids(spool)
    warmup = named(spool, "forward")[0]
    (evaluation,) = named(spool, "eval_step")  # a forward-only iteration: an eval_step under the session
    assert warmup["parent_id"] == evaluation["id"] and evaluation["parent_id"] == session["id"]
    assert steps[0]["start_ns"] >= warmup["end_ns"]
    for number, step in enumerate(steps):
        assert step["parent_id"] == session["id"]
        phases = {k["name"]: k for k in tree[step["id"]]}
        assert set(phases) == {"forward", "backward", "optimizer_step"}
        assert step["end_ns"] == phases["optimizer_step"]["end_ns"]
        if number == 0:
            assert step["start_ns"] == phases["forward"]["start_ns"]  # from its first phase
        else:
            assert step["start_ns"] == steps[number - 1]["end_ns"]  # from the previous optimizer step
        assert step["attrs"]["forward_ns"] == phases["forward"]["end_ns"] - phases["forward"]["start_ns"]
        assert len(step["mark_ids"]) == 2  # the program's loss and the inferred one, each on its own step
    assert [m["span_id"] for m in own_marks(spool)] == [s["id"] for s in steps]
    assert [m["span_id"] for m in spool.marks if m["name"] == "loss" and m["attrs"].get("inferred")] == [
        s["id"] for s in steps]


def test_gradient_accumulation_without_a_dataloader_is_one_step(tmp_path: Path) -> None:
    model, optimizer, _train, _ = setup()
    start(tmp_path)
    for _ in range(3):
        for _micro in range(2):
            nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 3
    tree = kids(spool)
    for step in steps:
        names = sorted(k["name"] for k in tree[step["id"]])
        assert names == ["backward", "backward", "forward", "forward", "optimizer_step"]


class _MovesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.as_subclass(_FakeDeviceCopy).to("cuda").as_subclass(torch.Tensor))


def test_h2d_inside_forward_is_not_counted_twice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _MovesItsInput()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start(tmp_path)
    for _ in range(3):
        with stepwatch.trace_step(model):
            moved = torch.randn(2, 4).as_subclass(_FakeDeviceCopy).to("cuda").as_subclass(torch.Tensor)
            model(moved).sum().backward()
            optimizer.step()
    spool = finish(tmp_path)

    tree = kids(spool)
    for step in named(spool, "step"):
        (h2d,) = [k for k in tree[step["id"]] if k["name"] == "h2d"]  # the copy before forward only
        (forward,) = [k for k in tree[step["id"]] if k["name"] == "forward"]
        assert tree[forward["id"]] == []
        attrs = step["attrs"]
        assert attrs["h2d_ns"] == h2d["end_ns"] - h2d["start_ns"]
        assert attrs["forward_ns"] >= 2_000_000  # the copy inside forward is forward time
        busy = attrs["h2d_ns"] + attrs["forward_ns"] + attrs["backward_ns"] + attrs["optimizer_step_ns"]
        assert busy <= attrs["step_ns"]


# -- ranks sharing <run>/spool ---------------------------------------------------------------


def _train_rank(run_dir: Path, rank: int, steps: int) -> Any:
    model, optimizer, _train, _ = setup()
    runtime = stepwatch.init(out=run_dir, handle_signals=False, capture_oom=False, rank=rank, world_size=2,
                             spool_interval=0.05, spool_max_bytes=64 * 1024)
    for i in range(steps):
        with stepwatch.trace_step(model):
            train_step(model, optimizer, torch.randn(4, 4), torch.randn(4, 1))
            stepwatch.mark("note", "x" * 300, rank=rank)
        if i % 20 == 0:
            time.sleep(0.06)  # let the spool seal: many batches
    spool = runtime.spool
    stepwatch.shutdown()
    return spool


def test_a_rank_evicts_only_its_own_spool_batches(tmp_path: Path) -> None:
    first = _train_rank(tmp_path, 0, 10)
    spool_dir = tmp_path / "spool"
    rank0_files = sorted(spool_dir.glob("*.json"))
    assert rank0_files and first.evicted_batches == 0
    second = _train_rank(tmp_path, 1, 600)  # far more than its 64 KiB cap

    state = (f"rank 1 wrote {second.batches_written} batches, evicted {second.evicted_batches} "
             f"({second.evicted_records} records); on disk {sorted(p.name for p in spool_dir.glob('*.json'))}")
    assert second.evicted_batches > 0 and second.evicted_records > 0, state
    assert all(path.exists() for path in rank0_files), state  # rank 0's batches are not rank 1's to drop
    mine = [p for p in spool_dir.glob("*.json") if p not in rank0_files]
    assert sum(p.stat().st_size for p in mine) <= 64 * 1024, state  # the cap is per writer
    spool = read_spool(tmp_path)
    sessions = [s for s in spool.spans if s["name"] == SESSION]
    assert sorted(s["rank"] for s in sessions) == [0, 1], state


# -- stepwatch import of one spool batch -----------------------------------------------------


def test_import_of_one_spool_batch_file(tmp_path: Path) -> None:
    import json

    from stepwatch.store import open_store
    from stepwatch.store.importers import import_path

    model, optimizer, train, _ = setup(samples=64)
    run_dir = tmp_path / "run"
    stepwatch.init(out=run_dir, handle_signals=False, capture_oom=False, spool_interval=0.05, interval=0.05)
    for x, y in train:
        with stepwatch.trace_step(model):
            stepwatch.mark("loss", train_step(model, optimizer, x, y))
        time.sleep(0.1)
    stepwatch.shutdown()
    files = sorted((run_dir / "spool").glob("*.json"))
    assert len(files) >= 2
    batch = max(files, key=lambda p: len(json.loads(p.read_bytes())["spans"]))
    body = json.loads(batch.read_bytes())

    store = open_store(tmp_path / "history.sqlite")
    try:
        written = import_path(batch, store)
    finally:
        store.close()
    assert written.get("spans") == len(body["spans"]) > 0  # that batch, and only it
    assert written.get("marks", 0) == len(body["marks"])
    assert "telemetry" not in written


# -- @inference: each request its own scope tree ---------------------------------------------


def test_concurrent_async_and_streaming_requests_keep_their_own_trees(tmp_path: Path) -> None:
    import asyncio

    torch.manual_seed(0)
    model = nn.Linear(4, 2)

    @stepwatch.inference
    async def answer(tag: int) -> int:
        with stepwatch.scope("retrieve", tag=tag):
            await asyncio.sleep(0.01 * (3 - tag))  # the requests interleave
            with torch.no_grad():
                model(torch.randn(1, 4))
            stepwatch.mark("tag", tag)
        await asyncio.sleep(0.005)
        stepwatch.mark("done", tag)
        return tag

    @stepwatch.inference
    async def stream(tag: int) -> Any:
        for token in range(3):
            with stepwatch.scope("decode", tag=tag):
                await asyncio.sleep(0.003)
                stepwatch.mark("token", token)
            yield token

    async def consume(tag: int) -> list[int]:
        return [token async for token in stream(tag)]

    @stepwatch.inference
    def sync_stream(tag: int) -> Any:
        for token in range(2):
            with stepwatch.scope("decode", tag=tag):
                stepwatch.mark("token", token)
            yield token

    async def main() -> None:
        results = await asyncio.gather(answer(0), answer(1), answer(2), consume(10), consume(11))
        assert results[:3] == [0, 1, 2]

    start(tmp_path)
    asyncio.run(main())
    first, second = sync_stream(20), sync_stream(21)
    for _ in range(2):  # two sync streams consumed alternately on one thread
        next(first), next(second)
    with stepwatch.scope("outside"):
        assert list(first) == list(second) == []
    spool = finish(tmp_path)

    by_id = spool.span_by_id()
    requests = [s for s in spool.spans if s["name"] == "request"]
    assert len(requests) == 7 and all(r["parent_id"] is None for r in requests)

    def request_of(span: dict[str, Any]) -> dict[str, Any]:
        while span["name"] != "request":
            span = by_id[span["parent_id"]]
        return span

    for name in ("retrieve", "decode"):
        for scope in (s for s in spool.spans if s["name"] == name):
            assert scope["parent_id"] in {r["id"] for r in requests}  # directly under a request
    tag_of_request = {}
    for scope in (s for s in spool.spans if s["name"] in ("retrieve", "decode")):
        tag_of_request.setdefault(request_of(scope)["id"], set()).add(scope["attrs"]["tag"])
    assert all(len(tags) == 1 for tags in tag_of_request.values())  # never another request's scope
    assert len(tag_of_request) == 7
    for forward in (s for s in spool.spans if s["name"] == "forward"):
        assert by_id[forward["parent_id"]]["name"] == "retrieve"
    for mark in spool.marks:
        if mark["name"] in ("tag", "token"):
            span = by_id[mark["span_id"]]
            assert span["name"] in ("retrieve", "decode")
            if mark["name"] == "tag":
                assert span["attrs"]["tag"] == mark["value"]
        elif mark["name"] == "done":
            request = by_id[mark["span_id"]]
            assert request["name"] == "request"
            (retrieve,) = [s for s in spool.spans if s["parent_id"] == request["id"]]
            assert retrieve["attrs"]["tag"] == mark["value"]
    (outside,) = [s for s in spool.spans if s["name"] == "outside"]
    assert by_id[outside["parent_id"]]["name"] == SESSION  # the streams left no stack behind
    assert sum(1 for m in spool.marks if m["name"] == "output_tokens") == 4


def test_span_table_appended_is_a_plain_read() -> None:
    from stepwatch.capture.spans import SpanTable

    table = SpanTable("spans", 4)
    assert table.appended == table.appended == 0
    for i in range(6):
        table.append(i)  # type: ignore[arg-type]
    assert table.appended == table.appended == 6
    assert len(table.drain()) == 4 and table.evicted == 2 and table.appended == 6


# -- snapshots: one blob file per snapshot ---------------------------------------------------


def test_second_snapshot_on_a_span_keeps_its_own_blobs(tmp_path: Path) -> None:
    import shutil

    from stepwatch.capture.snapshots import load_snapshot_tensor

    model, optimizer, train, _ = setup()
    start(tmp_path / "run")
    taken: list[dict[str, torch.Tensor]] = []
    for _ in stepwatch.epochs(1):
        for round_ in range(2):  # two full snapshots on the same epoch span, training between
            for x, y in train:  # the last batch's gradients are kept for the snapshot
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
            stepwatch.snapshot(model, "full", round=round_)  # the pass is over: on the epoch
            taken.append({**{n: p.detach().clone() for n, p in model.named_parameters()},
                          **{f"{n}.grad": p.grad.clone() for n, p in model.named_parameters()}})
            optimizer.zero_grad()
    spool = finish(tmp_path / "run")

    records = spool.snapshots
    assert len(records) == 2 * 8 and len({r["span_id"] for r in records}) == 1
    assert len({r["blob_uri"] for r in records}) == 4  # weights and gradients, per snapshot
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "run"), moved)  # the absolute URIs are stale: resolved by their tail
    for record in records:
        expected = taken[record["attrs"]["round"]][record["tensor_name"]]
        assert torch.equal(load_snapshot_tensor(record, moved), expected), record["tensor_name"]
        assert torch.equal(load_snapshot_tensor(record, moved / "spool"), expected)
    # a gradient keyed by the bare parameter name (the real SDK's files) resolves too
    grad = next(r for r in records if r["tensor_name"].endswith(".grad"))
    from safetensors.torch import save_file

    bare = moved / "snapshots" / "x" / "gradients.safetensors"
    bare.parent.mkdir()
    save_file({grad["tensor_name"].removesuffix(".grad"): torch.ones(3)}, str(bare))
    legacy = {**grad, "blob_uri": "file:///elsewhere/.cirron/snapshots/x/gradients.safetensors"}
    assert torch.equal(load_snapshot_tensor(legacy, moved), torch.ones(3))
    assert load_snapshot_tensor({**grad, "blob_uri": None}, moved) is None
