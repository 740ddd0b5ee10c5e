"""The training-loop shapes that step inference must count right with no ``trace_step`` and no
``stepwatch.epochs()`` (issue 15, part 1). Real tiny torch loops on CPU; the spool is read back.

A step is a ``step`` span (training) or an ``eval_step`` span (forwards only), with the breakdown
attrs ``step_ns``, ``data_load_ns``, ``h2d_ns``, ``forward_ns``, ``backward_ns``,
``optimizer_step_ns``, ``recompute_ns`` and ``wait_ns``. Phase times are exclusive: a phase nested
in another counts once, as itself, so a step's phase times never add up to more than the step.

Shapes and the rule each one checks:

* manual update (no optimizer object), over sliced tensors or a DataLoader: a forward-backward
  pair is enough to infer a step; forwards with gradients off after it are ``eval_step``s;
* a peek at the loader (``next(iter(loader))`` before each pass): an abandoned iterator is no
  epoch, and its fetch lands in no step;
* gradient accumulation (``optimizer.step()`` every 4 micro-batches): one step per optimizer
  update, holding its micro-batches' fetches, forwards and backwards, with or without a
  DataLoader;
* several optimizers per iteration (a GAN): one iteration is one step; ``attrs["optimizers"]``
  gives each optimizer's own time (``<class>#<k>``, k in the order each first stepped);
* an optimizer that evaluates a closure (LBFGS): the closure's forwards and backwards nest under
  ``optimizer_step`` in the tree but count as forward and backward, not also as optimizer;
* activation checkpointing: the forwards recomputed during backward are ``recompute`` spans and
  ``recompute_ns``, neither forward nor backward time;
* validation inside the training loop (a ``no_grad`` forward after each optimizer step): an
  ``eval_step`` of its own, never part of the next training step's forward;
* random interleavings of loader, forward, backward and optimizer calls (hypothesis): no
  negative time, no step inside a step, no epoch without a fetch, no step whose phase times add
  up to more than the step.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import stepwatch
from stepwatch import guard
from stepwatch.artifacts.spool import LoadedSpool
from tests.support import examples

from .test_inferred import SESSION, finish, kids, named, start

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("training_test")]

STEPS = ("step", "eval_step")
BREAKDOWN = ("step_ns", "data_load_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_step_ns",
             "recompute_ns", "wait_ns")
EXCLUSIVE = ("data_load_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_step_ns", "recompute_ns")
Span = dict[str, Any]


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """On tensors this small torch's intra-op threads only spin: with 2 of them a 50-iteration GAN
    took 1.2 s of CPU here, with 1 it takes 0.16 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def mlp(inputs: int = 4, outputs: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 8), nn.ReLU(), nn.Linear(8, outputs))


def tensors(samples: int, inputs: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(samples, inputs), torch.randn(samples, 1)


def sliced(x: torch.Tensor, y: torch.Tensor, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches sliced from tensors: a loop with no DataLoader."""
    for i in range(0, len(x), size):
        yield x[i:i + size], y[i:i + size]


def batches(x: torch.Tensor, y: torch.Tensor, size: int, loader: bool) -> Any:
    return DataLoader(TensorDataset(x, y), batch_size=size) if loader else sliced(x, y, size)


def manual_update(model: nn.Module, lr: float = 0.05) -> None:
    """Plain SGD written by hand: no optimizer object, so no optimizer hook fires."""
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
        p.grad.zero_()


def duration(span: Span) -> int:
    return span["end_ns"] - span["start_ns"]


def names(spans: list[Span]) -> Counter[str]:
    return Counter(s["name"] for s in spans)


def ancestors(span: Span, by_id: dict[str, Span]) -> Iterator[Span]:
    parent = by_id.get(span["parent_id"])
    while parent is not None:
        yield parent
        parent = by_id.get(parent["parent_id"])


def descendants(span: Span, tree: dict[str, list[Span]]) -> Iterator[Span]:
    todo = list(tree[span["id"]])
    while todo:
        child = todo.pop()
        yield child
        todo.extend(tree[child["id"]])


def steps_and_evals(spool: LoadedSpool) -> list[Span]:
    return sorted((s for s in spool.spans if s["name"] in STEPS), key=lambda s: s["start_ns"])


def assert_breakdown(step: Span, *, several_optimizers: bool = False) -> dict[str, Any]:
    """Every breakdown attr there (``recompute_ns`` too), none negative, the exclusive phase
    times within the step; ``optimizers`` only on a step that ran more than one optimizer."""
    attrs = step["attrs"]
    where = f"{step['name']} {step['index']}"
    missing = [key for key in BREAKDOWN if key not in attrs]
    assert not missing, f"{where} lacks {missing}: {attrs}"
    assert all(attrs[key] >= 0 for key in BREAKDOWN), f"{where}: {attrs}"
    assert attrs["step_ns"] == duration(step), where
    busy = sum(attrs[key] for key in EXCLUSIVE)
    assert busy <= attrs["step_ns"], f"{where}: phases {busy} ns > step {attrs['step_ns']} ns: {attrs}"
    if not several_optimizers:
        assert "optimizers" not in attrs, f"{where}: {attrs}"
    return attrs


def train_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


# -- 1. no optimizer object ------------------------------------------------------------------


@pytest.mark.parametrize("loader", [False, True], ids=["sliced", "dataloader"])
def test_manual_update_is_a_step_per_iteration_and_forwards_only_are_eval_steps(tmp_path: Path,
                                                                                loader: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    x, y = tensors(240)
    held_out = torch.randn(7, 2, 4)
    start(tmp_path)
    for xb, yb in batches(x, y, 8, loader):  # 30 batches
        nn.functional.mse_loss(model(xb), yb).backward()
        manual_update(model)
    with torch.no_grad():  # evaluation: 7 forwards, no loader
        for xb in held_out:
            model(xb)
    spool = finish(tmp_path)

    steps, evals = named(spool, "step"), named(spool, "eval_step")
    assert len(steps) == 30, f"{len(steps)} steps for 30 forward-backward iterations"
    assert len(evals) == 7, f"{len(evals)} eval steps for 7 forwards under no_grad"
    tree = kids(spool)
    for step in steps:
        mine = names(tree[step["id"]])
        assert mine["forward"] == 1 and mine["backward"] == 1, mine
        assert mine["data_load"] == (1 if loader else 0), mine
        attrs = assert_breakdown(step)
        assert attrs["forward_ns"] > 0 and attrs["backward_ns"] > 0
        assert attrs["optimizer_step_ns"] == 0
    for evaluation in evals:
        assert names(tree[evaluation["id"]]) == Counter(forward=1)
        assert evaluation["start_ns"] >= steps[-1]["end_ns"]
        assert_breakdown(evaluation)
    if loader:  # one pass over the training loader: one epoch holding every step
        (epoch,) = named(spool, "epoch")
        assert all(step["parent_id"] == epoch["id"] for step in steps)


def test_a_short_manual_update_run_ending_in_evaluation_ends_with_eval_steps(tmp_path: Path) -> None:
    """Fewer iterations than the machine holds while it learns the loop (no optimizer object),
    then evaluation until the process ends: the last forward is evaluation too, not a training
    step cut short."""
    torch.manual_seed(0)
    model = mlp()
    x, y = tensors(80)
    start(tmp_path)
    for xb, yb in sliced(x, y, 8):  # 10 iterations
        nn.functional.mse_loss(model(xb), yb).backward()
        manual_update(model)
    with torch.no_grad():
        for xb in torch.randn(3, 2, 4):
            model(xb)
    spool = finish(tmp_path)

    assert [s["name"] for s in steps_and_evals(spool)] == ["step"] * 10 + ["eval_step"] * 3
    assert not any("unclosed" in s["attrs"] for s in steps_and_evals(spool))


# -- 2. a peek at the loader -----------------------------------------------------------------


def test_a_peek_at_the_loader_is_no_epoch_and_its_fetch_is_in_no_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(*tensors(24)), batch_size=8)  # 3 batches a pass
    start(tmp_path)
    for _epoch in range(5):
        batch_size = len(next(iter(loader))[0])  # the peek of the DDP tutorials
        assert batch_size == 8
        for xb, yb in loader:
            train_step(model, optimizer, xb, yb)
    spool = finish(tmp_path)

    epochs = named(spool, "epoch")
    assert len(epochs) == 5, f"{len(epochs)} epochs for 5 passes: {[duration(e) for e in epochs]}"
    tree = kids(spool)
    steps = named(spool, "step")
    assert len(steps) == 15
    for epoch in epochs:
        assert names(tree[epoch["id"]])["step"] == 3
    by_id = spool.span_by_id()
    for step in steps:
        loads = names(tree[step["id"]])["data_load"]
        assert loads == 1, f"step {step['index']} holds {loads} fetches for the 1 batch it trained on"
        assert_breakdown(step)
    in_steps = [d for d in named(spool, "data_load") if any(a["name"] in STEPS for a in ancestors(d, by_id))]
    assert len(in_steps) == 15  # the batches trained on; the peeks' fetches are in no step


# -- 3. gradient accumulation ----------------------------------------------------------------


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "sliced"])
def test_gradient_accumulation_is_one_step_per_optimizer_update(tmp_path: Path, loader: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = tensors(100)
    start(tmp_path)
    for number, (xb, yb) in enumerate(batches(x, y, 1, loader)):  # 100 micro-batches
        (nn.functional.mse_loss(model(xb), yb) / 4).backward()
        if number % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 25, f"{len(steps)} steps for 25 optimizer updates of 4 micro-batches"
    tree = kids(spool)
    expected = Counter(forward=4, backward=4, optimizer_step=1) + (Counter(data_load=4) if loader else Counter())
    for step in steps:
        assert names(tree[step["id"]]) == expected, f"step {step['index']}"
        attrs = assert_breakdown(step)
        assert attrs["optimizer_step_ns"] > 0
    assert named(spool, "eval_step") == []


# -- 4. several optimizers per iteration -----------------------------------------------------


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "sliced"])
def test_a_gan_iteration_is_one_step_naming_both_optimizers(tmp_path: Path, loader: bool) -> None:
    torch.manual_seed(0)
    generator, discriminator = mlp(2, 2), mlp(2, 1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    bce = nn.functional.binary_cross_entropy_with_logits
    real = torch.randn(400, 2) + 3
    start(tmp_path)
    for xb, _ in batches(real, torch.zeros(400, 1), 8, loader):  # 50 iterations
        ones, zeros = torch.ones(len(xb), 1), torch.zeros(len(xb), 1)
        fake = generator(torch.randn(len(xb), 2))
        opt_d.zero_grad()
        (bce(discriminator(xb), ones) + bce(discriminator(fake.detach()), zeros)).backward()
        opt_d.step()  # the discriminator steps first: the lower k
        opt_g.zero_grad()
        bce(discriminator(fake), ones).backward()
        opt_g.step()
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 50, f"{len(steps)} steps for 50 iterations of 2 optimizer steps"
    tree = kids(spool)
    labels: set[tuple[str, ...]] = set()
    for step in steps:
        opts = sorted((k for k in tree[step["id"]] if k["name"] == "optimizer_step"), key=lambda s: s["start_ns"])
        assert len(opts) == 2, f"step {step['index']}: {names(tree[step['id']])}"
        attrs = assert_breakdown(step, several_optimizers=True)
        per_optimizer = attrs.get("optimizers")
        assert isinstance(per_optimizer, dict) and len(per_optimizer) == 2, attrs
        assert sum(per_optimizer.values()) == attrs["optimizer_step_ns"]
        ks = sorted((int(re.fullmatch(r"Adam#(\d+)", label)[1]), label)  # type: ignore[index]
                    for label in per_optimizer)
        assert ks[1][0] == ks[0][0] + 1, per_optimizer  # first stepped one after the other
        # the discriminator's (first stepped, lower k) time is the first optimizer_step's own time
        assert [per_optimizer[label] for _k, label in ks] == [duration(o) for o in opts]
        labels.add(tuple(label for _k, label in ks))
    assert len(labels) == 1  # the same two optimizers, named alike in every step


# -- 5. an optimizer that evaluates a closure ------------------------------------------------


def test_closure_phases_nest_under_the_optimizer_step_and_count_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)
    x, y = tensors(80)
    start(tmp_path)
    for xb, yb in sliced(x, y, 16):  # 5 steps
        def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            return loss

        optimizer.step(closure)
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 5
    tree = kids(spool)
    by_id = spool.span_by_id()
    for step in steps:
        (opt,) = [k for k in tree[step["id"]] if k["name"] == "optimizer_step"]
        inside = tree[opt["id"]]
        assert names(inside)["forward"] >= 1 and names(inside)["backward"] >= 1
        attrs = step["attrs"]
        busy = sum(attrs.get(key, 0) for key in EXCLUSIVE)
        assert busy <= attrs["step_ns"], f"step {step['index']}: phases {busy} ns > step {attrs['step_ns']} ns"
        assert attrs["optimizer_step_ns"] < duration(opt), "the closure's phases are counted as optimizer too"
        assert attrs["optimizer_step_ns"] == duration(opt) - sum(duration(k) for k in inside)
        assert attrs["forward_ns"] == sum(duration(k) for k in inside if k["name"] == "forward")
        assert attrs["backward_ns"] == sum(duration(k) for k in inside if k["name"] == "backward")
        assert_breakdown(step)
    for phase in named(spool, "forward") + named(spool, "backward"):
        assert by_id[phase["parent_id"]]["name"] == "optimizer_step"  # nesting kept in the tree


# -- 6. activation checkpointing -------------------------------------------------------------


class _Checkpointed(nn.Module):
    """A stem, three blocks recomputed during backward, a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(4, 8)  # the blocks' input requires grad (reentrant checkpoint needs it)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_forwards_recomputed_in_backward_are_recompute(tmp_path: Path, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = tensors(80)
    start(tmp_path)
    for xb, yb in sliced(x, y, 8):  # 10 steps
        train_step(model, optimizer, xb, yb)
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert len(steps) == 10
    tree = kids(spool)
    by_id = spool.span_by_id()
    for step in steps:
        assert names(tree[step["id"]]) == Counter(forward=1, backward=1, optimizer_step=1), f"step {step['index']}"
        (backward,) = [k for k in tree[step["id"]] if k["name"] == "backward"]
        recomputes = tree[backward["id"]]
        assert names(recomputes) == Counter(recompute=3), f"under backward: {names(recomputes)}"
        attrs = step["attrs"]
        assert attrs.get("recompute_ns", 0) > 0, attrs
        assert attrs["recompute_ns"] == sum(duration(r) for r in recomputes)
        assert attrs["backward_ns"] == duration(backward) - attrs["recompute_ns"]
        busy = attrs["forward_ns"] + attrs["backward_ns"] + attrs["recompute_ns"] + attrs["optimizer_step_ns"]
        assert busy <= attrs["step_ns"]
        assert_breakdown(step)
    for forward in named(spool, "forward"):
        assert by_id[forward["parent_id"]]["name"] == "step"  # the outermost model call only


# -- 7. validation inside the training loop --------------------------------------------------


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "sliced"])
def test_validation_after_each_optimizer_step_is_an_eval_step(tmp_path: Path, loader: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = tensors(160)
    held_out = torch.randn(8, 4)
    start(tmp_path)
    for xb, yb in batches(x, y, 8, loader):  # 20 iterations
        train_step(model, optimizer, xb, yb)
        with torch.no_grad():
            model(held_out)
    spool = finish(tmp_path)

    steps, evals = named(spool, "step"), named(spool, "eval_step")
    assert (len(steps), len(evals)) == (20, 20), f"{len(steps)} steps, {len(evals)} eval steps"
    assert [s["name"] for s in steps_and_evals(spool)] == ["step", "eval_step"] * 20
    tree = kids(spool)
    by_id = spool.span_by_id()
    for step in steps:
        forwards = [k for k in tree[step["id"]] if k["name"] == "forward"]
        assert len(forwards) == 1, f"step {step['index']}: {len(forwards)} forwards"
        attrs = assert_breakdown(step)
        assert attrs["forward_ns"] == duration(forwards[0])  # no validation forward in it
    for evaluation in evals:
        assert names(tree[evaluation["id"]]) == Counter(forward=1)
        assert_breakdown(evaluation)
    for forward in named(spool, "forward"):  # the last validation too: no bare forward
        assert by_id[forward["parent_id"]]["name"] in STEPS, by_id[forward["parent_id"]]["name"]


# -- 7b. a frozen network beside the one that trains --------------------------------------------


@pytest.mark.parametrize("loader", [True, False], ids=["dataloader", "sliced"])
@pytest.mark.parametrize("update", ["optimizer", "manual"])
@pytest.mark.parametrize("teacher_first", [True, False], ids=["teacher-first", "student-first"])
def test_a_teachers_forward_without_gradients_is_part_of_the_training_step(tmp_path: Path, loader: bool,
                                                                          update: str, teacher_first: bool) -> None:
    """Distillation: a frozen teacher's forward under ``no_grad`` beside the student's, each
    iteration, is the step's forward work, never an evaluation step (a target network's in RL
    is the same shape). The same model's forward under ``no_grad`` stays evaluation (the tests
    of validation above)."""
    torch.manual_seed(0)
    teacher, student = mlp().eval(), mlp()
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05)
    x, y = tensors(160)
    start(tmp_path)
    for xb, _ in batches(x, y, 8, loader):  # 20 iterations
        if teacher_first:
            with torch.no_grad():
                target = teacher(xb)
            loss = nn.functional.mse_loss(student(xb), target)
        else:
            out = student(xb)
            with torch.no_grad():
                target = teacher(xb)
            loss = nn.functional.mse_loss(out, target)
        loss.backward()
        if update == "optimizer":
            optimizer.step()
            optimizer.zero_grad()
        else:
            manual_update(student)
    spool = finish(tmp_path)

    steps, evals = named(spool, "step"), named(spool, "eval_step")
    assert (len(steps), len(evals)) == (20, 0), f"{len(steps)} steps, {len(evals)} eval steps"
    tree = kids(spool)
    for step in steps:
        mine = names(tree[step["id"]])
        assert mine["forward"] == 2 and mine["backward"] == 1, mine
        assert mine["data_load"] == (1 if loader else 0), mine
        assert_breakdown(step)


def test_a_gradient_penalty_is_backward_time_of_its_step(tmp_path: Path) -> None:
    """WGAN-GP's critic: ``torch.autograd.grad`` of the critic's output for its input, inside
    each step, is the step's backward time (with the step's own backward), one step per update;
    outside a step it makes none."""
    torch.manual_seed(0)
    critic = mlp()
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3)
    x, _ = tensors(80)
    probe = torch.randn(4, 4, requires_grad=True)
    start(tmp_path)
    torch.autograd.grad(critic(probe).sum(), probe)  # before any step: no step of its own
    for xb, _yb in sliced(x, x, 8):  # 10 updates
        mix = xb.clone().requires_grad_(True)
        (slope,) = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
        loss = critic(xb).mean() + 10 * ((slope.norm(dim=1) - 1) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    spool = finish(tmp_path)

    steps = named(spool, "step")
    assert [s["name"] for s in steps_and_evals(spool)] == ["step"] * 10
    tree = kids(spool)
    for step in steps[1:]:  # the first: the loop's mode still unknown, the penalty not timed
        backwards = [k for k in tree[step["id"]] if k["name"] == "backward"]
        assert len(backwards) == 2, names(tree[step["id"]])
        attrs = assert_breakdown(step)
        assert attrs["backward_ns"] == sum(duration(b) for b in backwards)


# -- 8. random interleavings (hypothesis) ----------------------------------------------------

OPS = ("iter", "fetch", "forward", "forward_no_grad", "teacher", "backward", "step_a", "step_b", "abandon")


def _run_ops(run_dir: Path, ops: list[str]) -> LoadedSpool:
    """One random program on a tiny model: optimizer A owns the first layer, B the last."""
    torch.manual_seed(0)
    model, teacher = mlp(), mlp()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.01)
    opt_b = torch.optim.Adam(model[2].parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(*tensors(12)), batch_size=4)  # 3 batches a pass
    iterators: list[Any] = []
    batch = tensors(4)
    loss: torch.Tensor | None = None
    start(run_dir)
    for op in ops:
        if op == "iter":
            iterators.append(iter(loader))
        elif op == "fetch" and iterators:
            try:
                batch = next(iterators[-1])
            except StopIteration:
                iterators.pop()
        elif op == "forward":
            loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        elif op == "forward_no_grad":
            with torch.no_grad():
                model(batch[0])
        elif op == "teacher":  # a frozen network's forward (distillation's teacher)
            with torch.no_grad():
                teacher(batch[0])
        elif op == "backward" and loss is not None:
            loss.backward()
            loss = None
        elif op in ("step_a", "step_b"):
            optimizer = opt_a if op == "step_a" else opt_b
            optimizer.step()
            optimizer.zero_grad()
            loss = None  # its graph saw the weights before the update: backward would raise
        elif op == "abandon" and iterators:
            iterators.pop(0)
    return finish(run_dir)


def assert_sound(spool: LoadedSpool) -> None:
    by_id = spool.span_by_id()
    tree = kids(spool)
    for span in spool.spans:
        where = f"{span['name']} {span.get('index')}"
        assert span["end_ns"] >= span["start_ns"], where
        for key, value in (span.get("attrs") or {}).items():
            if key.endswith("_ns"):
                assert value >= 0, f"{where}: {key} = {value}"
            elif key == "optimizers":
                assert all(v >= 0 for v in value.values()), f"{where}: {value}"
        if span["name"] in STEPS:
            outer = [a["name"] for a in ancestors(span, by_id) if a["name"] in STEPS]
            assert not outer, f"{where} inside {outer}"
            attrs = span["attrs"]
            busy = sum(attrs.get(key, 0) for key in EXCLUSIVE)
            assert busy <= attrs["step_ns"] + 1_000, f"{where}: phases {busy} ns > step: {attrs}"
        elif span["name"] == "epoch":
            assert any(d["name"] == "data_load" for d in descendants(span, tree)), f"{where} has no fetch"
    (session,) = [s for s in spool.spans if s["name"] == SESSION]
    for span in spool.spans:  # every span in the session's tree: none lost its parent
        chain = list(ancestors(span, by_id))
        assert span is session or (chain and chain[-1] is session), f"{span['name']} outside the session"


# derandomize: the same examples on every run (the suite stays deterministic); no database
@settings(max_examples=examples(40), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(OPS), min_size=1, max_size=30))
# the training loader known, then two passes begun back to back: the first has no fetch
@example(["iter", "fetch", "forward", "backward", "step_a", "fetch", "iter", "iter", "fetch"])
# an optimizer step before the first fetch of a pass: no epoch holds that step without its fetch
@example(["iter", "step_a", "fetch"])
# a peek after training began, then the next pass trains
@example(["iter", "fetch", "forward", "backward", "step_a", "iter", "fetch", "abandon", "iter", "fetch", "forward",
          "backward", "step_a"])
# two optimizers in one iteration, a grad-off forward, then a forward-backward left without an update
@example(["forward", "backward", "step_a", "step_b", "forward_no_grad", "forward", "backward"])
def test_random_interleavings_keep_the_step_tree_sound(ops: list[str]) -> None:
    guard.reset_swallowed()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spool = _run_ops(Path(tmp), ops)
        finally:
            stepwatch.shutdown()
        assert_sound(spool)
    assert guard.swallowed() == {}, guard.recent_swallowed()
