"""``stepwatch.capture.integrations.huggingface.StepwatchCallback`` on a real ``transformers.Trainer``.

Tiny models built here, a few steps on CPU, nothing from the hub (``HF_HUB_OFFLINE``). The
spool is read back with ``read_spool`` and checked against the canonical scope shape of
spool-format-v1.md: one ``epoch`` per epoch (siblings under the session), one ``step`` per
optimizer step, ``forward``/``backward``/``optimizer_step`` under each step, no duplicates.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never reach the hub

import pytest

from tests.support.lazy import installed, lazy_module
from tests.support.marks import own_marks
from tests.support.spool_tree import children, named

# every test here starts a process or trains a model
pytestmark = [pytest.mark.real, pytest.mark.skipif(not installed("transformers"), reason="needs transformers")]

torch = pytest.importorskip("torch")
transformers = lazy_module("transformers")  # imported by the worker that runs a test of this module
huggingface = lazy_module("stepwatch.capture.integrations.huggingface")  # it imports transformers

import stepwatch  # noqa: E402
from stepwatch.artifacts.spool import LoadedSpool, read_spool  # noqa: E402
from stepwatch.capture import api, training  # noqa: E402
from stepwatch.capture.spans import SpanRecorder  # noqa: E402
from stepwatch.capture.training import TrainingState  # noqa: E402
from stepwatch.errors import ConfigError, IntegrationUnavailable  # noqa: E402
from stepwatch.guard import reset_swallowed, swallowed  # noqa: E402

# transformers.Trainer needs accelerate; the callback itself does not (see the driven test).
needs_trainer = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                   reason="transformers.Trainer needs accelerate>=1.1")

QUIET = {"handle_signals": False, "capture_oom": False}


# -- fixtures and helpers ----------------------------------------------------------------------


# run_dir: tests/capture/integrations/conftest.py


class TinyRegressor(torch.nn.Module):
    """A model in the Trainer's contract: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        out = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class RegressionData(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = torch.randn(n, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i]}


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 50, (n, 6), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": self.labels[i]}


def training_args(tmp_path: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "trainer"), "num_train_epochs": 2, "per_device_train_batch_size": 4,
        "logging_steps": 1, "report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True,
    }
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def assert_canonical(spool: LoadedSpool, *, epochs: int, steps_per_epoch: int, framework: str) -> None:
    """Epochs are siblings under the session; each owns its steps; each step has one
    forward, backward and optimizer_step child, summed onto its attrs."""
    (session,) = named(spool, "stepwatch.session")
    epoch_spans = named(spool, "epoch")
    assert [e["index"] for e in epoch_spans] == list(range(epochs))
    assert all(e["parent_id"] == session["id"] for e in epoch_spans)
    assert all(e["attrs"]["framework"] == framework for e in epoch_spans)
    steps = named(spool, "step")
    assert [s["index"] for s in steps] == list(range(epochs * steps_per_epoch))
    for epoch in epoch_spans:
        assert len(children(spool, epoch, "step")) == steps_per_epoch
    for step in steps:
        assert step["attrs"]["framework"] == framework
        for phase in ("forward", "backward", "optimizer_step"):
            (child,) = children(spool, step, phase)
            assert step["start_ns"] <= child["start_ns"] <= child["end_ns"] <= step["end_ns"]
            assert step["attrs"][f"{phase}_ns"] == child["end_ns"] - child["start_ns"]
        assert "unclosed" not in step["attrs"] and "error" not in step["attrs"]
    assert not named(spool, "eval_step")
    # the torch patches time phases only inside steps while a framework drives the loop
    for phase in ("forward", "backward", "optimizer_step"):
        assert {by_id(spool, s["parent_id"])["name"] for s in named(spool, phase)} == {"step"}


def by_id(spool: LoadedSpool, span_id: str) -> dict[str, Any]:
    return next(s for s in spool.spans if s["id"] == span_id)


def marks_on_steps(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    step_ids = {s["id"] for s in named(spool, "step")}
    return [m for m in own_marks(spool) if m["name"] == name and m["span_id"] in step_ids]




# -- the Trainer -------------------------------------------------------------------------------


@needs_trainer
def test_trainer_run_has_one_epoch_per_epoch_one_step_per_optimizer_step(run_dir: Path, tmp_path: Path) -> None:
    trainer = transformers.Trainer(model=TinyRegressor(), args=training_args(tmp_path),
                                   train_dataset=RegressionData(), callbacks=[huggingface.StepwatchCallback()])
    trainer.train()
    assert api.current_runtime().active  # the program started stepwatch: the callback leaves it
    assert training._state is not None and "transformers" not in training._state.owners
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2, framework="transformers")
    for name in ("loss", "learning_rate", "grad_norm"):
        marks = marks_on_steps(spool, name)
        assert [m["attrs"]["step"] for m in marks] == [1, 2, 3, 4], name
        assert all(m["value_type"] == "float" for m in marks)
    # each mark is listed by the step it is on, and was made after the step's end was taken
    steps = {s["id"]: s for s in named(spool, "step")}
    for mark in marks_on_steps(spool, "loss"):
        assert mark["id"] in steps[mark["span_id"]]["mark_ids"]
        assert mark["ts_ns"] >= steps[mark["span_id"]]["end_ns"]
    assert not any(m["name"] == "epoch" for m in spool.marks)
    assert any(m["name"] == "train_loss" for m in spool.marks)  # the closing summary log
    # the plan the live view's progress bar reads: the Trainer's own max_steps
    (plan,) = [m for m in spool.marks if m["name"] == "stepwatch.plan"]
    assert plan["attrs"]["max_steps"] == 4 and plan["attrs"]["epochs"] == 2 and plan["kind"] == "summary"


@needs_trainer
def test_lower_priority_hooks_yield_to_the_trainer(run_dir: Path, tmp_path: Path) -> None:
    """A BERT built from a config, with the user also wrapping the loop in stepwatch.epochs and
    every training step in stepwatch.trace_step: still one epoch and one step each."""
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, max_position_embeddings=16)
    model = transformers.BertForSequenceClassification(config)

    class TracedTrainer(transformers.Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            with stepwatch.trace_step(model):
                stepwatch.mark("user_mark", 1)
                return super().training_step(model, inputs, num_items_in_batch)

    trainer = TracedTrainer(model=model, args=training_args(tmp_path), train_dataset=TokenData(),
                            callbacks=[huggingface.StepwatchCallback()])
    for _ in stepwatch.epochs(1):
        trainer.train()
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2, framework="transformers")
    assert len(marks_on_steps(spool, "user_mark")) == 4  # the user's marks land on the Trainer's steps
    assert len(marks_on_steps(spool, "loss")) == 4


@needs_trainer
def test_callback_starts_and_stops_stepwatch_when_nobody_did(tmp_path: Path) -> None:
    assert not api.current_runtime().active
    reset_swallowed()
    out = tmp_path / "own-run"
    trainer = transformers.Trainer(model=TinyRegressor(), args=training_args(tmp_path, num_train_epochs=1),
                                   train_dataset=RegressionData(),
                                   callbacks=[huggingface.StepwatchCallback(init_kwargs={"out": out, **QUIET})])
    try:
        trainer.train()
        assert not api.current_runtime().active
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
    spool = read_spool(out)
    assert_canonical(spool, epochs=1, steps_per_epoch=2, framework="transformers")


class Boom(Exception):
    """The user's own error."""


class FailingRegressor(TinyRegressor):
    def __init__(self, fail_at_call: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at_call = fail_at_call
        self.boom: Boom | None = None

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        self.calls += 1
        if self.calls == self.fail_at_call:
            self.boom = Boom("user code failed")
            raise self.boom
        return super().forward(x, labels)


@needs_trainer
def test_a_user_exception_propagates_and_the_next_train_starts_clean(run_dir: Path, tmp_path: Path) -> None:
    model = FailingRegressor(fail_at_call=2)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=RegressionData(),
                                   callbacks=[huggingface.StepwatchCallback()])
    with pytest.raises(Boom) as info:
        trainer.train()
    assert info.value is model.boom
    trainer.train()  # transformers has no exception event: the failed run's spans close here
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    failed_epoch, *epochs = named(spool, "epoch")
    first_step, failed_step, *steps = named(spool, "step")
    assert "unclosed" not in first_step["attrs"]
    assert failed_epoch["attrs"]["unclosed"] is True and failed_step["attrs"]["unclosed"] is True
    assert [e["index"] for e in epochs] == [0, 1] and len(steps) == 4
    assert all("unclosed" not in s["attrs"] for s in [*epochs, *steps])
    for step in steps:
        assert {c["name"] for c in children(spool, step)} >= {"forward", "backward", "optimizer_step"}


@needs_trainer
def test_a_broken_stepwatch_never_breaks_the_trainer(run_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stepwatch bug")

    monkeypatch.setattr(TrainingState, "open_epoch", broken)
    monkeypatch.setattr(TrainingState, "open_step", broken)
    monkeypatch.setattr(SpanRecorder, "mark_on", broken)
    trainer = transformers.Trainer(model=TinyRegressor(), args=training_args(tmp_path),
                                   train_dataset=RegressionData(), callbacks=[huggingface.StepwatchCallback()])
    result = trainer.train()
    assert result.global_step == 4
    failures = swallowed()
    assert {"transformers.open_epoch", "transformers.open_step", "transformers.mark"} <= set(failures)
    reset_swallowed()


# -- the callback's events, driven by hand (no accelerate needed) ------------------------------


def test_events_driven_by_hand_give_the_canonical_shape(run_dir: Path) -> None:
    """The Trainer's event order, with real forward/backward/optimizer work in each step; a
    logged step stays open for its marks but ends where on_step_end was called."""
    model = TinyRegressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = RegressionData()
    callback = huggingface.StepwatchCallback()
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback.on_train_begin(None, state, control)
    for epoch in range(2):
        callback.on_epoch_begin(None, state, control)
        for batch in range(2):
            callback.on_step_begin(None, state, control)
            out = model(data.x[batch * 4:batch * 4 + 4], labels=data.y[batch * 4:batch * 4 + 4])
            out["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
            state.global_step += 1
            control.should_log = batch == 1  # log every second step
            callback.on_step_end(None, state, control)
            if control.should_log:
                callback.on_log(None, state, control, logs={"loss": out["loss"].item(), "epoch": epoch + 1.0,
                                                            "learning_rate": 0.1, "grad_norm": 1.5, "flag": True})
        callback.on_epoch_end(None, state, control)
    callback.on_train_end(None, state, control)
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert_canonical(spool, epochs=2, steps_per_epoch=2, framework="transformers")
    own = {m["id"] for m in own_marks(spool)}
    logged = [s for s in named(spool, "step") if own & set(s["mark_ids"])]
    assert [s["index"] for s in logged] == [1, 3]
    for name in ("loss", "learning_rate", "grad_norm"):
        assert [m["span_id"] for m in marks_on_steps(spool, name)] == [s["id"] for s in logged]
    assert not any(m["name"] in ("flag", "epoch") for m in spool.marks)  # booleans and the epoch are not marks


def test_callback_without_stepwatch_does_nothing() -> None:
    reset_swallowed()
    callback = huggingface.StepwatchCallback(init_kwargs={"enabled": False})
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    for event in ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end",
                  "on_train_end"):
        assert getattr(callback, event)(None, state, control) is None
    callback.on_log(None, state, control, logs={"loss": 1.0})
    assert not api.current_runtime().active
    assert swallowed() == {}


def test_invalid_init_kwargs_raise_where_the_callback_is_built() -> None:
    with pytest.raises(ConfigError):
        huggingface.StepwatchCallback(init_kwargs={"interval": -1})
    with pytest.raises(ConfigError):
        huggingface.StepwatchCallback(init_kwargs={"no_such_option": 1})


# -- self-gating --------------------------------------------------------------------------------


@pytest.mark.parametrize("shadow", [None, "too-old"])
def test_module_refuses_a_missing_or_old_transformers(shadow: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if shadow is None:
        monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    else:
        fake = types.ModuleType("transformers")
        fake.__version__ = "4.1.0"  # type: ignore[attr-defined]
        fake.TrainerCallback = object  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.delitem(sys.modules, "stepwatch.capture.integrations.huggingface", raising=False)
    with pytest.raises(IntegrationUnavailable) as info:
        importlib.import_module("stepwatch.capture.integrations.huggingface")
    assert info.value.library == "transformers"
    assert isinstance(info.value, ImportError)


def test_core_imports_no_training_framework(tmp_path: Path) -> None:
    code = """
        import json, sys
        import stepwatch, stepwatch.capture.training, stepwatch.capture.api, stepwatch.capture.integrations
        stepwatch.trace_step, stepwatch.epochs, stepwatch.mark
        heavy = ("transformers", "lightning", "pytorch_lightning")
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@needs_trainer
@pytest.mark.parametrize("logging_steps", [1, 100])  # the step closes in on_log, or in on_step_end
def test_a_halt_stops_the_trainer_its_own_way_and_train_returns(run_dir: Path, tmp_path: Path,
                                                                logging_steps: int) -> None:
    import time

    stepwatch.request_halt(run_dir, at_step=3, reason="make room")
    runtime = api.current_runtime()
    deadline = time.monotonic() + 10
    while runtime.halt is None:  # type: ignore[union-attr]  # the sampler reads .HALT at its tick
        assert time.monotonic() < deadline, "the halt was never read"
        time.sleep(0.05)
    trainer = transformers.Trainer(model=TinyRegressor(), args=training_args(tmp_path, num_train_epochs=5,
                                                                             logging_steps=logging_steps),
                                   train_dataset=RegressionData(), callbacks=[huggingface.StepwatchCallback()])
    trainer.train()  # no Halt raised: the Trainer's own stop ends the run
    assert trainer.state.global_step == 3
    assert runtime.step == 3 and runtime.outcome() == "halted"  # type: ignore[union-attr]
    end = json.loads((run_dir / "outcome_rank0.json").read_text())
    assert end["outcome"] == "halted" and end["halt"]["step"] == 3
