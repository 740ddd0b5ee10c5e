"""``stepwatch.capture.integrations.lightning.StepwatchCallback`` on a real Lightning ``Trainer``.

Tiny LightningModules built here, a few steps on CPU. The spool is read back with
``read_spool`` and checked against the canonical scope shape of spool-format-v1.md. Lightning
runs ``training_step`` and ``backward`` inside ``optimizer.step(closure)``, so these tests also
pin that ``forward`` and ``backward`` are siblings of ``optimizer_step`` under the step, never
its children.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.support.lazy import installed, lazy_module
from tests.support.marks import own_marks
from tests.support.spool_tree import children, named

torch = pytest.importorskip("torch")
pl = lazy_module("lightning.pytorch")  # imported by the worker that runs a test of this module
lightning = lazy_module("stepwatch.capture.integrations.lightning")  # it imports Lightning
modules = lazy_module("tests.capture.integrations.lightning_modules")

import stepwatch  # noqa: E402
from stepwatch.artifacts.spool import LoadedSpool, read_spool  # noqa: E402
from stepwatch.capture import api, training  # noqa: E402
from stepwatch.capture.spans import SpanRecorder  # noqa: E402
from stepwatch.capture.training import TrainingState  # noqa: E402
from stepwatch.errors import ConfigError, IntegrationUnavailable  # noqa: E402
from stepwatch.guard import reset_swallowed, swallowed  # noqa: E402

# Lightning's own pytree helper trips a typing_extensions deprecation on this torch; not ours.
pytestmark = [pytest.mark.real, pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
              pytest.mark.skipif(not installed("lightning"), reason="needs lightning")]

QUIET = {"handle_signals": False, "capture_oom": False}
PHASES = ("forward", "backward", "optimizer_step")


# -- fixtures and helpers ----------------------------------------------------------------------


# run_dir: tests/capture/integrations/conftest.py; the LightningModules: lightning_modules.py


def loader(n: int = 8) -> Any:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=generator), torch.randn(n, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=4)


def make_trainer(callback: Any, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": 2, "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "callbacks": [callback],
    }
    options.update(overrides)
    return pl.Trainer(**options)


def parent_names(spool: LoadedSpool, name: str) -> set[str]:
    ids = {s["id"]: s["name"] for s in spool.spans}
    return {ids[s["parent_id"]] for s in named(spool, name)}


def assert_canonical(spool: LoadedSpool, *, epochs: int, steps_per_epoch: int,
                     micro_batches: int = 1) -> None:
    (session,) = named(spool, "stepwatch.session")
    epoch_spans = named(spool, "epoch")
    assert [e["index"] for e in epoch_spans] == list(range(epochs))
    assert all(e["parent_id"] == session["id"] for e in epoch_spans)
    steps = named(spool, "step")
    assert [s["index"] for s in steps] == list(range(epochs * steps_per_epoch))
    for epoch in epoch_spans:
        assert len(children(spool, epoch, "step")) == steps_per_epoch
    for step in steps:
        assert step["attrs"]["framework"] == "lightning"
        assert "unclosed" not in step["attrs"] and "error" not in step["attrs"]
        counts = {"forward": micro_batches, "backward": micro_batches, "optimizer_step": 1}
        for phase in PHASES:
            spans = children(spool, step, phase)
            assert len(spans) == counts[phase], phase
            assert all(step["start_ns"] <= s["start_ns"] <= s["end_ns"] <= step["end_ns"] for s in spans)
            assert step["attrs"][f"{phase}_ns"] == sum(s["end_ns"] - s["start_ns"] for s in spans)
        forward_end = max(s["end_ns"] for s in children(spool, step, "forward"))
        (optimizer,) = children(spool, step, "optimizer_step")
        assert optimizer["start_ns"] >= forward_end  # the closure is not timed as the optimizer
    for phase in PHASES:
        assert parent_names(spool, phase) == {"step"}
    assert not named(spool, "eval_step")


def marks_on_steps(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    step_ids = {s["id"] for s in named(spool, "step")}
    return [m for m in own_marks(spool) if m["name"] == name and m["span_id"] in step_ids]




# -- fit ----------------------------------------------------------------------------------------


def test_fit_has_one_epoch_per_epoch_one_step_per_optimizer_step(run_dir: Path) -> None:
    module = modules.TinyModule()
    trainer = make_trainer(lightning.StepwatchCallback())
    trainer.fit(module, loader())
    assert api.current_runtime().active  # the program started stepwatch: the callback leaves it
    assert training._state is not None and "lightning" not in training._state.owners
    assert not {"training_step", "batch_to_device"} & set(vars(trainer.strategy))  # wrappers taken off
    assert "training_step" not in vars(module)  # the user's module is never patched
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2)
    for name in ("loss", "learning_rate", "grad_norm", "train_loss_step"):
        marks = marks_on_steps(spool, name)
        assert [m["attrs"]["step"] for m in marks] == [1, 2, 3, 4], name
        assert all(m["value_type"] == "float" for m in marks)
    assert all(m["value"] == 0.05 for m in marks_on_steps(spool, "learning_rate"))
    loss = [m["value"] for m in marks_on_steps(spool, "loss")]
    assert loss == [m["value"] for m in marks_on_steps(spool, "train_loss_step")]
    epoch_ids = {e["id"] for e in named(spool, "epoch")}
    epoch_marks = [m for m in spool.marks if m["name"] == "train_loss_epoch"]
    assert len(epoch_marks) == 2 and {m["span_id"] for m in epoch_marks} == epoch_ids
    # the plan the live view's progress bar reads: Lightning's estimate of the fit's steps
    (plan,) = [m for m in spool.marks if m["name"] == "stepwatch.plan"]
    assert plan["attrs"] == {"max_steps": 4, "epochs": 2} and plan["kind"] == "summary"


def test_lower_priority_hooks_yield_to_lightning(run_dir: Path) -> None:
    """The user also wraps the fit in stepwatch.epochs and each training_step in trace_step:
    still one epoch and one step each. The user's marks, made inside training_step, land on
    the innermost scope there: the step's forward."""
    trainer = make_trainer(lightning.StepwatchCallback())
    for _ in stepwatch.epochs(1):
        trainer.fit(modules.TinyModule(trace=True), loader())
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2)
    spans = {s["id"]: s for s in spool.spans}
    user_marks = [m for m in spool.marks if m["name"] == "user_mark"]
    assert [m["value"] for m in user_marks] == [0, 1, 0, 1]
    assert {spans[m["span_id"]]["name"] for m in user_marks} == {"forward"}
    assert {spans[spans[m["span_id"]]["parent_id"]]["name"] for m in user_marks} == {"step"}


def test_a_user_exception_propagates_unchanged(run_dir: Path) -> None:
    module = modules.TinyModule(fail_at=1)
    trainer = make_trainer(lightning.StepwatchCallback())
    with pytest.raises(modules.Boom) as info:
        trainer.fit(module, loader())
    assert info.value is module.boom
    assert not {"training_step", "batch_to_device"} & set(vars(trainer.strategy))
    assert training._state is not None and "lightning" not in training._state.owners
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    first, failed = named(spool, "step")
    assert "error" not in first["attrs"]
    assert failed["attrs"]["error"] == "Boom" and "unclosed" not in failed["attrs"]
    (epoch,) = named(spool, "epoch")
    assert epoch["attrs"]["error"] == "Boom"
    (forward,) = children(spool, failed, "forward")  # ended by the wrapper's finally
    assert "unclosed" not in forward["attrs"]


def test_gradient_accumulation_makes_one_step_per_optimizer_update(run_dir: Path) -> None:
    trainer = make_trainer(lightning.StepwatchCallback(), accumulate_grad_batches=2)
    trainer.fit(modules.TinyModule(), loader())
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=1, micro_batches=2)
    assert len(marks_on_steps(spool, "grad_norm")) == 2
    # the loss marks are training_step's own values, not Lightning's accumulation-scaled ones
    loss = [m["value"] for m in marks_on_steps(spool, "loss")]
    assert loss == [m["value"] for m in marks_on_steps(spool, "train_loss_step")]


def test_manual_optimization(run_dir: Path) -> None:
    trainer = make_trainer(lightning.StepwatchCallback())
    trainer.fit(modules.ManualModule(), loader())
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2)
    assert len(marks_on_steps(spool, "loss")) == 4
    assert len(marks_on_steps(spool, "grad_norm")) == 4


def test_lightning_yields_to_transformers(run_dir: Path) -> None:
    assert training._state is not None
    training._state.claim("transformers")
    trainer = make_trainer(lightning.StepwatchCallback())
    trainer.fit(modules.TinyModule(), loader())
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert not named(spool, "epoch") and not named(spool, "step")
    assert not marks_on_steps(spool, "loss")


def test_callback_starts_and_stops_stepwatch_when_nobody_did(tmp_path: Path) -> None:
    assert not api.current_runtime().active
    reset_swallowed()
    out = tmp_path / "own-run"
    trainer = make_trainer(lightning.StepwatchCallback(init_kwargs={"out": out, **QUIET}), max_epochs=1)
    try:
        trainer.fit(modules.TinyModule(), loader())
        assert not api.current_runtime().active
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
    assert_canonical(read_spool(out), epochs=1, steps_per_epoch=2)


def test_a_broken_stepwatch_never_breaks_the_fit(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stepwatch bug")

    monkeypatch.setattr(TrainingState, "open_epoch", broken)
    monkeypatch.setattr(TrainingState, "close_step", broken)
    monkeypatch.setattr(SpanRecorder, "mark_on", broken)
    module = modules.TinyModule()
    trainer = make_trainer(lightning.StepwatchCallback())
    trainer.fit(module, loader())
    assert trainer.global_step == 4
    assert {"lightning.open_epoch", "lightning.close_step", "lightning.mark"} <= set(swallowed())
    reset_swallowed()


def test_invalid_init_kwargs_raise_where_the_callback_is_built() -> None:
    with pytest.raises(ConfigError):
        lightning.StepwatchCallback(init_kwargs={"table_rows": 1})


# -- self-gating --------------------------------------------------------------------------------


@pytest.mark.parametrize("shadow", [None, "too-old"])
def test_module_refuses_a_missing_or_old_lightning(shadow: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if shadow is None:
        monkeypatch.setitem(sys.modules, "lightning", None)  # `import lightning` fails
    else:
        fake = types.ModuleType("lightning")
        fake.__version__ = "1.9.5"  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "lightning", fake)
    monkeypatch.delitem(sys.modules, "stepwatch.capture.integrations.lightning", raising=False)
    with pytest.raises(IntegrationUnavailable) as info:
        importlib.import_module("stepwatch.capture.integrations.lightning")
    assert info.value.library == "lightning"


# -- a coherent halt (docs/halt.md) -----------------------------------------------------------


def _arm_halt(run_dir: Path, at_step: int) -> Any:
    import time

    stepwatch.request_halt(run_dir, at_step=at_step, reason="make room")
    runtime = api.current_runtime()
    deadline = time.monotonic() + 10
    while runtime.halt is None:  # type: ignore[union-attr]  # the sampler reads .HALT at its tick
        assert time.monotonic() < deadline, "the halt was never read"
        time.sleep(0.05)
    return runtime


def test_a_halt_stops_the_trainer_its_own_way_and_fit_returns(run_dir: Path) -> None:
    import json

    runtime = _arm_halt(run_dir, 3)
    trainer = make_trainer(lightning.StepwatchCallback(), max_epochs=5)  # 2 batches an epoch: 10 steps
    trainer.fit(modules.TinyModule(), loader())  # no Halt raised: Lightning's own stop ends the fit
    assert trainer.should_stop and trainer.global_step == 3
    assert runtime.step == 3 and runtime.outcome() == "halted"
    end = json.loads((run_dir / "outcome_rank0.json").read_text())
    assert end["outcome"] == "halted" and end["halt"]["step"] == 3


def test_a_halt_before_min_steps_stops_the_fit_with_halt(run_dir: Path) -> None:
    runtime = _arm_halt(run_dir, 3)
    trainer = make_trainer(lightning.StepwatchCallback(), max_epochs=5, min_steps=6)  # Lightning would train on
    with pytest.raises(stepwatch.Halt) as raised:
        trainer.fit(modules.TinyModule(), loader())
    assert raised.value.step == 3 and trainer.global_step == 3
    assert runtime.outcome() == "halted"


def test_a_fit_that_trains_on_past_the_halt_step_is_stopped_by_halt(run_dir: Path) -> None:
    class KeepGoing(pl.Callback):
        """A user's callback that undoes the stop flag (after stepwatch's, which comes first)."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            trainer.should_stop = False

    runtime = _arm_halt(run_dir, 3)
    trainer = make_trainer(lightning.StepwatchCallback(), max_epochs=5)
    trainer.callbacks.append(KeepGoing())
    with pytest.raises(stepwatch.Halt) as raised:  # the rank must not pass the step every rank stops at
        trainer.fit(modules.TinyModule(), loader())
    assert raised.value.step == 3 and trainer.global_step == 3
    assert runtime.outcome() == "halted"
