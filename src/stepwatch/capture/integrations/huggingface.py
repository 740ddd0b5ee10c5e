"""Hugging Face ``transformers.Trainer`` integration: ``StepwatchCallback``.

Importing this module imports transformers; it raises ``IntegrationUnavailable`` when
transformers is missing or older than 4.30. The Trainer's own callback events drive the
spans (spool-format-v1.md, "Canonical scope shape"), and transformers is the highest-priority
owner of epoch and step, so ``stepwatch.epochs``/``trace_step``/``batches`` in user code yield
to it while it trains::

    session
      epoch[n]                  on_epoch_begin .. on_epoch_end, or the end of the evaluation
                                (and checkpoint) the Trainer runs at the epoch's end
        step[n]                 one optimizer step: from the fetch of its first micro-batch
                                (``get_batch_samples``) to on_step_end
          data_load             the batches fetched for the step (torch patches)
          forward, backward, optimizer_step   (torch patches, summed onto the step)
        eval_step[n]            one evaluation batch (``prediction_step``)
          forward

``on_log`` values (loss, learning_rate, grad_norm, any other number) become marks on the step
they were logged for; the Trainer logs right after ``on_step_end``, so a step that will be
logged keeps its span open until ``on_log`` while its end time is taken at ``on_step_end``.
Evaluation metrics (``eval_loss``, ...) land on the epoch they were computed in.

The Trainer hands its callbacks no event before a step's batches are fetched or before an
evaluation batch, so ``instrument_trainer`` (applied by ``autoattach`` while stepwatch runs)
also wraps ``Trainer.get_batch_samples`` and ``Trainer.prediction_step``; it attaches a
``StepwatchCallback`` to every Trainer built without one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ...errors import IntegrationUnavailable
from ...guard import Site, report_internal
from . import FrameworkLink, require_version

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised by shadowing the module in tests
    raise IntegrationUnavailable("transformers", f"cannot be imported ({exc}); pip install transformers") from exc

require_version("transformers", getattr(transformers, "__version__", "0"), (4, 30))

__all__ = ["StepwatchCallback", "auto_callback", "instrument_trainer"]

FRAMEWORK = "transformers"
_NOT_MARKED = frozenset({"epoch"})  # already the epoch span; kept as an attribute of the marks


class StepwatchCallback(TrainerCallback):
    """Records a ``transformers.Trainer`` run: epochs, optimizer steps, and logged values.

    Starts stepwatch at ``on_train_begin`` when it is not running (with ``init_kwargs``), and
    then also shuts it down at ``on_train_end``; a stepwatch the program started is left running.
    Never raises into the Trainer: its own errors are logged once and swallowed.

    Example::

        stepwatch.init(out="runs/bert")
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[StepwatchCallback()])
        trainer.train()
        stepwatch.shutdown()

    Args:
        init_kwargs: options for ``stepwatch.init`` when the callback starts stepwatch itself.

    Raises:
        ConfigError: ``init_kwargs`` holds an invalid option (raised here, not during training).
    """

    auto_attached = False  # True on the one stepwatch attached by itself (``auto_callback``)

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None) -> None:
        self._link = FrameworkLink(FRAMEWORK, init_kwargs)
        self._next_epoch = 0
        self._epoch_ending = False  # on_epoch_end came; the epoch waits for its evaluation

    # TrainerCallback's events each take (args, state, control, **kwargs); None keeps `control`.

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.start()
        self._link.plan(max_steps=getattr(state, "max_steps", None),
                        epochs=getattr(state, "num_train_epochs", None) or getattr(args, "num_train_epochs", None))
        try:
            # A resumed run starts at its checkpoint's epoch.
            self._next_epoch = int((state.epoch or 0) + 1e-6)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.TRANSFORMERS_ON_TRAIN_BEGIN)
            self._next_epoch = 0

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_ending = False
        self._link.open_epoch(self._next_epoch)
        self._next_epoch += 1

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        link = self._link
        link.settle()
        link.close_step()
        # DefaultFlowCallback (first in the list) has set the flags: an evaluation or a
        # checkpoint of this epoch follows right after this event, and belongs to the epoch.
        if getattr(control, "should_evaluate", False) or getattr(control, "should_save", False):
            self._epoch_ending = True
        else:
            link.close_epoch()

    def _end_epoch(self) -> None:
        if self._epoch_ending:
            self._epoch_ending = False
            self._link.close_epoch()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_epoch()
        self._link.open_step()  # open already when get_batch_samples opened it

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # DefaultFlowCallback runs first and sets should_log; when it is set, the Trainer's
        # `_maybe_log_save_evaluate` calls on_log next, before any other work of the loop.
        if getattr(control, "should_log", False):
            self._link.end_step_later()
        else:
            self._link.close_step()
            self._stop_for_halt(control)

    def _stop_for_halt(self, control: Any) -> None:
        """A ``stepwatch halt`` step done: the Trainer's own stop, checked right after the step
        closes (here, or in on_log for a step kept open for its logs); the Trainer breaks out of
        its loop before the next batch and ends its run as on any stop."""
        if self._link.stop_for_halt():
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        link = self._link
        try:
            if logs:
                attrs: dict[str, Any] = {"step": int(getattr(state, "global_step", 0) or 0)}
                epoch = logs.get("epoch")
                if isinstance(epoch, (int, float)) and not isinstance(epoch, bool):
                    attrs["epoch"] = epoch
                for name, value in logs.items():
                    if name in _NOT_MARKED or isinstance(value, bool) or not isinstance(value, (int, float)):
                        continue
                    link.mark(name, value, **attrs)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.TRANSFORMERS_ON_LOG)
        link.settle()
        self._stop_for_halt(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.settle()
        if not getattr(control, "should_save", False):
            self._end_epoch()  # else the checkpoint after it is still the epoch's

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.settle()
        self._end_epoch()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_ending = False
        self._link.stop()


def auto_callback() -> StepwatchCallback:
    """The callback stepwatch attaches to a Trainer built without one: it drives the Trainer's
    run while stepwatch runs, and never starts stepwatch itself."""
    callback = StepwatchCallback()
    callback.auto_attached = True
    callback._link.start_runtime = False
    return callback


def _is_stepwatch_callback(callback: Any) -> bool:
    """A ``StepwatchCallback`` instance, or the class (``Trainer(callbacks=[StepwatchCallback])``)."""
    return isinstance(callback, StepwatchCallback) or (
        isinstance(callback, type) and issubclass(callback, StepwatchCallback))


def _callback_of(trainer: Any) -> StepwatchCallback | None:
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        if isinstance(callback, StepwatchCallback):
            return callback
    return None


# The Trainer's printers pop ``total_flos`` from the logs they are handed: the callback goes
# before them, where a callback given in ``callbacks=`` sits, and so sees what it would see.
_PRINTERS = frozenset({"PrinterCallback", "ProgressCallback", "NotebookProgressCallback"})


def _attach(trainer: Any) -> None:
    """Adds the auto-attached callback, unless the Trainer has a ``StepwatchCallback`` already.
    Put in the handler's list directly: ``add_callback`` would warn about a duplicate class
    where a user's own callback of another class is fine."""
    handler = getattr(trainer, "callback_handler", None)
    if handler is None or _callback_of(trainer) is not None:
        return
    callbacks = handler.callbacks
    at = next((i for i, c in enumerate(callbacks) if type(c).__name__ in _PRINTERS), len(callbacks))
    callbacks.insert(at, auto_callback())


def instrument_trainer(module: ModuleType) -> Callable[[], None]:
    """Wraps ``module.Trainer`` (``transformers.trainer``) for stepwatch; returns the undo.

    ``__init__`` attaches the callback; ``add_callback`` of a ``StepwatchCallback`` replaces the
    attached one (once, never twice); ``get_batch_samples`` opens the optimizer step before its
    micro-batches are fetched; ``prediction_step`` is one ``eval_step``. Each wrapper does its
    own work inside a guard and calls the Trainer's method outside it.
    """
    from .autoattach import restore_all, wrap_method

    trainer_class = module.Trainer

    def wrap_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                _attach(self)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.TRANSFORMERS_ATTACH)

        return __init__

    def wrap_add_callback(original: Any) -> Any:
        def add_callback(self: Any, callback: Any) -> Any:
            try:
                if _is_stepwatch_callback(callback):
                    handler = self.callback_handler
                    handler.callbacks[:] = [c for c in handler.callbacks
                                            if not getattr(c, "auto_attached", False)]
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.TRANSFORMERS_ADD_CALLBACK)
            return original(self, callback)

        return add_callback

    def wrap_get_batch_samples(original: Any) -> Any:
        def get_batch_samples(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                callback = _callback_of(self)
                if callback is not None:
                    callback._end_epoch()
                    callback._link.open_step()
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.TRANSFORMERS_GET_BATCH_SAMPLES)
            return original(self, *args, **kwargs)

        return get_batch_samples

    def wrap_prediction_step(original: Any) -> Any:
        def prediction_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            link = None
            try:
                callback = _callback_of(self)
                link = callback._link if callback is not None else None
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.TRANSFORMERS_PREDICTION_STEP)
            if link is None or link.open_eval_step() is None:
                return original(self, *args, **kwargs)
            try:
                result = original(self, *args, **kwargs)
            except BaseException as exc:
                link.close_eval_step(exc)
                raise
            link.close_eval_step()
            return result

        return prediction_step

    return restore_all([
        wrap_method(trainer_class, "__init__", wrap_init),
        wrap_method(trainer_class, "add_callback", wrap_add_callback),
        wrap_method(trainer_class, "get_batch_samples", wrap_get_batch_samples),
        wrap_method(trainer_class, "prediction_step", wrap_prediction_step),
    ])


# last: a Trainer whose import waited on this module (it imported the framework itself) is wrapped now
from .autoattach import integration_ready  # noqa: E402

integration_ready("huggingface")
