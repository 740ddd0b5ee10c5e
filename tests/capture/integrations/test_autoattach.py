"""Framework runs recorded with no change to the script: while stepwatch runs, every
``transformers.Trainer`` and ``lightning.pytorch.Trainer`` gets one ``StepwatchCallback``
(``stepwatch.capture.integrations.autoattach``), never two when the program adds its own.

Real Trainers on tiny models built here from configs (``HF_HUB_OFFLINE``: nothing from the hub),
on CPU; the spool is read back with ``read_spool``. The import hook itself is exercised in fresh
interpreters (``stepwatch run`` on an unmodified Hugging Face script, and a Lightning Trainer
imported after ``stepwatch.init``), since this process has imported both frameworks already.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never reach the hub

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import ROOT, STEPWATCH, clean_env
from tests.support.lazy import installed, lazy_module
from tests.support.spool_tree import children, named

torch = pytest.importorskip("torch")
# imported by the worker that runs a test of this module, not by every worker that collects it
transformers = lazy_module("transformers")
pl = lazy_module("lightning.pytorch")
huggingface = lazy_module("stepwatch.capture.integrations.huggingface")
lightning = lazy_module("stepwatch.capture.integrations.lightning")
modules = lazy_module("tests.capture.integrations.lightning_modules")

import stepwatch  # noqa: E402
from stepwatch.artifacts.spool import LoadedSpool, read_spool  # noqa: E402
from stepwatch.capture import after_import, api  # noqa: E402
from stepwatch.capture.integrations import autoattach  # noqa: E402
from stepwatch.guard import reset_swallowed, swallowed  # noqa: E402

needs_trainer = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                   reason="transformers.Trainer needs accelerate>=1.1")
# Lightning's own pytree helper trips a typing_extensions deprecation on this torch; not ours.
pytestmark = [pytest.mark.real, pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
              pytest.mark.skipif(not (installed("transformers") and installed("lightning")),
                                 reason="needs transformers and lightning")]

QUIET = {"handle_signals": False, "capture_oom": False}
TRAIN_PHASES = ("forward", "backward", "optimizer_step")


# run_dir: tests/capture/integrations/conftest.py; the LightningModules: lightning_modules.py


@pytest.fixture(autouse=True)
def frameworks_imported() -> None:
    """Both frameworks imported before stepwatch starts (autouse fixtures come first), as the
    docstring says: the import hook itself is tested in fresh interpreters."""
    importlib.import_module("transformers")
    importlib.import_module("lightning.pytorch")


def parent_names(spool: LoadedSpool, name: str) -> Counter[str]:
    ids = {s["id"]: s["name"] for s in spool.spans}
    return Counter(ids.get(s["parent_id"], "?") for s in named(spool, name))


def marks_per_span(spool: LoadedSpool, name: str) -> Counter[str]:
    """The framework's own marks of ``name`` per span (not the ones inferred from backward and
    clip_grad_norm_, capture/inferred_metrics.py)."""
    return Counter(m["span_id"] for m in spool.marks if m["name"] == name and not (m.get("attrs") or {}).get("inferred"))


def inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    return parent["start_ns"] <= child["start_ns"] <= child["end_ns"] <= parent["end_ns"]


# -- Hugging Face ----------------------------------------------------------------------------


class CausalData(torch.utils.data.Dataset):
    """Token ids that are their own labels: what a causal LM trains on."""

    def __init__(self, n: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 8), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def hf_trainer(tmp_path: Path, callbacks: list[Any] | None = None, **overrides: Any) -> Any:
    """2 epochs of 12 samples in batches of 4 (3 optimizer steps each), evaluated at each
    epoch's end on 8 samples (2 eval batches), logging every step."""
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "trainer"), "num_train_epochs": 2, "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4, "eval_strategy": "epoch", "logging_steps": 1, "report_to": [],
        "use_cpu": True, "save_strategy": "no", "disable_tqdm": True,
    }
    options.update(overrides)
    return transformers.Trainer(model=tiny_gpt2(), args=transformers.TrainingArguments(**options),
                                train_dataset=CausalData(12), eval_dataset=CausalData(8, seed=1),
                                callbacks=callbacks)


def stepwatch_callbacks(trainer: Any) -> list[Any]:
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, huggingface.StepwatchCallback)]


def assert_hf_run(spool: LoadedSpool, *, epochs: int, steps_per_epoch: int, eval_batches: int,
                  train_batches: int, before_printer: bool = True) -> None:
    """Every training step inside its epoch (the last one too), every evaluation batch an
    eval_step inside the epoch it evaluated, each logged value marked once on its step."""
    (session,) = named(spool, "stepwatch.session")
    epoch_spans = named(spool, "epoch")
    assert [e["index"] for e in epoch_spans] == list(range(epochs))
    assert all(e["parent_id"] == session["id"] for e in epoch_spans)
    steps = named(spool, "step")
    assert [s["index"] for s in steps] == list(range(epochs * steps_per_epoch))
    for epoch in epoch_spans:
        epoch_steps = children(spool, epoch, "step")
        assert len(epoch_steps) == steps_per_epoch
        assert all(inside(s, epoch) for s in epoch_steps)
        evals = children(spool, epoch, "eval_step")
        assert len(evals) == eval_batches
        assert all(inside(e, epoch) and e["start_ns"] >= epoch_steps[-1]["end_ns"] for e in evals)
        for span in evals:
            assert [c["name"] for c in children(spool, span, "forward")] == ["forward"]
            assert not children(spool, span, "backward")
        assert marks_per_span(spool, "eval_loss")[epoch["id"]] == 1  # on the epoch it evaluated
    for step in steps:
        assert step["attrs"]["framework"] == "transformers"
        for phase in TRAIN_PHASES:
            assert len(children(spool, step, phase)) == 1, phase
    # forwards, backwards and optimizer steps happen inside steps only: none bare on an epoch
    assert set(parent_names(spool, "forward")) == {"step", "eval_step"}
    assert set(parent_names(spool, "backward")) == set(parent_names(spool, "optimizer_step")) == {"step"}
    # the training fetches are the steps' own (accelerate fetches one batch ahead: the first
    # fetch of each epoch is in its first step, with the second)
    assert parent_names(spool, "data_load")["step"] == train_batches
    assert parent_names(spool, "data_load")["stepwatch.session"] == 0
    step_ids = {s["id"] for s in steps}
    for name in ("loss", "learning_rate", "grad_norm"):
        per_span = marks_per_span(spool, name)
        assert {k: v for k, v in per_span.items() if k in step_ids} == dict.fromkeys(step_ids, 1), name
        assert sum(per_span.values()) == len(steps), name  # once each, never twice
    # the summary log at the end, whole: the attached callback sees the logs before the
    # Trainer's printer takes total_flos out, as one given in callbacks= does (one added with
    # add_callback comes after the printer)
    summary = {m["name"] for m in spool.marks if m["span_id"] == session["id"]}
    assert "train_loss" in summary and ("total_flos" in summary) is before_printer


@needs_trainer
@pytest.mark.parametrize("user", [None, "instance", "class", "add_callback"])
def test_trainer_run_recorded_whole_with_or_without_the_users_callback(run_dir: Path, tmp_path: Path,
                                                                       user: str | None) -> None:
    given = {"instance": [huggingface.StepwatchCallback()], "class": [huggingface.StepwatchCallback]}
    callbacks = given.get(user or "")
    trainer = hf_trainer(tmp_path, callbacks)
    if user == "add_callback":
        trainer.add_callback(huggingface.StepwatchCallback())
    (callback,) = stepwatch_callbacks(trainer)
    assert callback.auto_attached is (user is None)
    result = trainer.train()
    assert result.global_step == 6
    stepwatch.shutdown()
    assert_hf_run(read_spool(run_dir), epochs=2, steps_per_epoch=3, eval_batches=2, train_batches=6,
                  before_printer=user != "add_callback")


@needs_trainer
def test_gradient_accumulation_one_step_per_update_with_its_micro_batches(run_dir: Path, tmp_path: Path) -> None:
    """24 samples in batches of 2, 4 per update: 3 steps an epoch, each with its 4 forwards and
    backwards and the fetches of its micro-batches (fetched before on_step_begin)."""
    trainer = hf_trainer(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         num_train_epochs=1, eval_strategy="no")
    trainer.train_dataset = CausalData(24)
    assert trainer.train().global_step == 3
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    steps = named(spool, "step")
    assert len(steps) == 3
    for step in steps:
        counts = Counter(c["name"] for c in children(spool, step))
        assert counts["forward"] == counts["backward"] == 4 and counts["optimizer_step"] == 1
        assert counts["data_load"] >= 3  # the last micro-batch of the epoch was fetched ahead
    assert parent_names(spool, "data_load") == Counter({"step": 12})
    assert len(marks_per_span(spool, "loss")) == 3


@needs_trainer
def test_evaluate_alone_gives_eval_steps(run_dir: Path, tmp_path: Path) -> None:
    trainer = hf_trainer(tmp_path)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    assert len(named(spool, "eval_step")) == 2 and not named(spool, "step")
    assert set(parent_names(spool, "forward")) == {"eval_step"}


@needs_trainer
def test_attached_callback_never_starts_stepwatch(tmp_path: Path) -> None:
    reset_swallowed()
    stepwatch.init(out=tmp_path / "run", **QUIET)
    trainer = hf_trainer(tmp_path, num_train_epochs=1, eval_strategy="no")
    stepwatch.shutdown()
    assert stepwatch_callbacks(trainer)[0].auto_attached
    trainer.train()  # the program stopped stepwatch: it stays stopped, and nothing fails
    assert not api.current_runtime().active
    assert swallowed() == {}


@needs_trainer
def test_trainers_are_wrapped_while_stepwatch_runs_and_given_back_at_shutdown(tmp_path: Path) -> None:
    init = transformers.Trainer.__init__
    stepwatch.init(out=tmp_path / "run", **QUIET)
    assert transformers.Trainer.__init__ is not init and pl.Trainer.__init__.__stepwatch_original__
    stepwatch.shutdown()
    assert transformers.Trainer.__init__ is init
    assert not hasattr(transformers.Trainer.get_batch_samples, "__stepwatch_original__")
    assert not hasattr(pl.Trainer.__init__, "__stepwatch_original__")
    assert not autoattach.installed()
    assert not set(autoattach.TARGETS) & after_import.waiting()
    assert stepwatch_callbacks(hf_trainer(tmp_path)) == []
    # auto_instrument=False: no patch of torch, nor of the Trainers
    stepwatch.init(out=tmp_path / "quiet", auto_instrument=False, **QUIET)
    try:
        assert not autoattach.installed() and transformers.Trainer.__init__ is init
        assert stepwatch_callbacks(hf_trainer(tmp_path)) == []
    finally:
        stepwatch.shutdown()


@needs_trainer
def test_attaching_fails_open(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("stepwatch bug")

    monkeypatch.setattr("stepwatch.capture.integrations.huggingface.auto_callback", broken)  # the module, not the proxy
    trainer = hf_trainer(tmp_path, num_train_epochs=1, eval_strategy="no")
    assert trainer.train().global_step == 3
    assert stepwatch_callbacks(trainer) == []
    assert set(swallowed()) == {"transformers.attach"}
    reset_swallowed()


# -- Lightning -------------------------------------------------------------------------------


def loader(n: int, batch_size: int, seed: int = 0) -> Any:
    generator = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=generator), torch.randn(n, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


@pytest.mark.parametrize("user", [None, "instance", "append"])
def test_lightning_accumulation_one_step_per_optimizer_update(run_dir: Path, user: str | None) -> None:
    """60 batches, 4 per optimizer update: as many steps as global_step, each holding its 4
    fetches, forwards and backwards and its one optimizer step; validation batches are
    eval_steps (the sanity check's under the session, the epoch's in the epoch)."""
    callbacks = [lightning.StepwatchCallback()] if user == "instance" else None
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=4, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    if user == "append":
        trainer.callbacks.append(lightning.StepwatchCallback())
    ours = [c for c in trainer.callbacks if isinstance(c, lightning.StepwatchCallback)]
    assert len(ours) == (2 if user == "append" else 1)
    assert ours[0].auto_attached is (user != "instance")
    trainer.fit(modules.ValidatedRegressor(), loader(120, 2), loader(8, 4, seed=1))
    assert trainer.global_step == 15
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    (session,) = named(spool, "stepwatch.session")
    (epoch,) = named(spool, "epoch")
    steps = named(spool, "step")
    assert len(steps) == trainer.global_step
    assert all(s["parent_id"] == epoch["id"] and s["attrs"]["framework"] == "lightning" for s in steps)
    for step in steps:
        counts = Counter(c["name"] for c in children(spool, step))
        assert counts == Counter({"data_load": 4, "forward": 4, "backward": 4, "optimizer_step": 1}), step["index"]
    assert parent_names(spool, "data_load")["step"] == 60
    sanity = [e for e in named(spool, "eval_step") if e["parent_id"] == session["id"]]
    evals = children(spool, epoch, "eval_step")
    assert len(sanity) == 2 and all(e["attrs"]["sanity_check"] is True for e in sanity)
    assert len(evals) == 2 and all("sanity_check" not in e["attrs"] for e in evals)
    assert set(parent_names(spool, "forward")) == {"step", "eval_step"}
    step_ids = {s["id"] for s in steps}
    for name, per_step in (("loss", 4), ("learning_rate", 1), ("grad_norm", 1)):
        per_span = marks_per_span(spool, name)
        assert dict(per_span) == dict.fromkeys(step_ids, per_step), name  # once, never twice


def test_lightning_callback_from_configure_callbacks_replaces_the_attached_one(run_dir: Path) -> None:
    class WithCallback(modules.Regressor):
        def configure_callbacks(self) -> Any:
            return [lightning.StepwatchCallback()]

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2)
    assert [c.auto_attached for c in trainer.callbacks if isinstance(c, lightning.StepwatchCallback)] == [True]
    trainer.fit(WithCallback(), loader(16, 4))
    (callback,) = [c for c in trainer.callbacks if isinstance(c, lightning.StepwatchCallback)]
    assert not callback.auto_attached
    stepwatch.shutdown()
    spool = read_spool(run_dir)
    steps = named(spool, "step")
    assert len(steps) == trainer.global_step == 2
    for name, per_step in (("loss", 2), ("learning_rate", 1), ("grad_norm", 1)):
        assert dict(marks_per_span(spool, name)) == {s["id"]: per_step for s in steps}, name


def test_lightning_validate_alone_gives_eval_steps_and_survives_a_failing_batch(run_dir: Path) -> None:
    class Failing(modules.ValidatedRegressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                raise KeyError("user code failed")
            super().validation_step(batch, batch_idx)

    def trainer() -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False)

    with pytest.raises(KeyError):
        trainer().validate(Failing(), loader(12, 4))
    trainer().validate(modules.ValidatedRegressor(), loader(12, 4))
    stepwatch.shutdown()

    spool = read_spool(run_dir)
    evals = named(spool, "eval_step")
    assert [e["index"] for e in evals] == list(range(5)) and not named(spool, "step")
    assert [e["attrs"].get("error") for e in evals] == [None, "KeyError", None, None, None]
    assert set(parent_names(spool, "forward")) == {"eval_step"}


# -- fresh interpreters: the import hook -----------------------------------------------------


HF_SCRIPT = """
import os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments(output_dir=sys.argv[1], num_train_epochs=2, per_device_train_batch_size=4,
                         per_device_eval_batch_size=4, eval_strategy="epoch", logging_steps=1, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Data(12, 0), eval_dataset=Data(8, 1)).train()
"""


def trainer_env() -> dict[str, str]:
    """A clean environment that imports this checkout's stepwatch and never reaches the Hub."""
    env = clean_env(HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@needs_trainer
def test_stepwatch_run_records_an_unmodified_trainer_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HF_SCRIPT))
    out = tmp_path / "run"
    proc = subprocess.run([*STEPWATCH, "run", "--interval", "200", "--out", str(out), str(script),
                           str(tmp_path / "trainer")], check=False, cwd=tmp_path, env=trainer_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_hf_run(read_spool(out), epochs=2, steps_per_epoch=3, eval_batches=2, train_batches=6)


LIGHTNING_IMPORTED_AFTER_INIT = """
import json, sys
import stepwatch
stepwatch.init(out=sys.argv[1], handle_signals=False, capture_oom=False)
assert "lightning.pytorch" not in sys.modules
if sys.argv[2] == "integration-first":  # the integration imports Lightning itself, half built meanwhile
    from stepwatch.capture.integrations.lightning import StepwatchCallback
import lightning.pytorch as pl
from stepwatch.capture.integrations.lightning import StepwatchCallback
first = pl.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
second = pl.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False,
                    callbacks=[StepwatchCallback()])
stepwatch.shutdown()
after = pl.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
count = lambda t: [c.auto_attached for c in t.callbacks if isinstance(c, StepwatchCallback)]
print(json.dumps([count(first), count(second), count(after)]))
"""


@pytest.mark.parametrize("first", ["lightning-first", "integration-first"])
def test_lightning_imported_after_init_gets_the_callback(tmp_path: Path, first: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LIGHTNING_IMPORTED_AFTER_INIT), str(tmp_path / "r"),
                           first],
                          check=False, cwd=tmp_path, env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[True], [False], []]
    assert "internal error" not in proc.stderr


# -- once, never twice: any order of the program's own additions ------------------------------

_SHARED: dict[str, Any] = {}


def _shared_model() -> Any:
    if "model" not in _SHARED:
        _SHARED["model"] = tiny_gpt2()
    return _SHARED["model"]


def _shared_args(tmp_path: Path) -> Any:
    if "args" not in _SHARED:
        _SHARED["args"] = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to=[],
                                                         use_cpu=True, save_strategy="no", disable_tqdm=True)
    return _SHARED["args"]


_OPERATIONS = st.sampled_from(["instance", "class", "other", "remove_class", "pop_ours"])


@needs_trainer
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(given_callbacks=st.lists(st.sampled_from(["instance", "class", "other"]), max_size=3),
       operations=st.lists(_OPERATIONS, max_size=6))
def test_a_trainer_never_holds_the_attached_callback_next_to_another(
        run_dir: Path, tmp_path: Path, given_callbacks: list[str], operations: list[str]) -> None:
    """Built with any ``callbacks=`` list, then any sequence of ``add_callback`` /
    ``remove_callback`` / ``pop_callback``: at most one attached callback, and none at all next to
    a ``StepwatchCallback`` of the program's."""
    make = {"instance": huggingface.StepwatchCallback, "class": lambda: huggingface.StepwatchCallback,
            "other": transformers.PrinterCallback}
    trainer = transformers.Trainer(model=_shared_model(), args=_shared_args(tmp_path),
                                   callbacks=[make[kind]() for kind in given_callbacks])

    def check() -> None:
        ours = stepwatch_callbacks(trainer)
        attached = [c for c in ours if c.auto_attached]
        assert len(attached) <= 1
        assert not attached or len(ours) == 1

    check()
    assert stepwatch_callbacks(trainer)  # one at least, right after construction
    for operation in operations:
        if operation in make:
            trainer.add_callback(make[operation]())
        elif operation == "remove_class":
            trainer.remove_callback(huggingface.StepwatchCallback)
        else:
            trainer.pop_callback(huggingface.StepwatchCallback)
        check()
