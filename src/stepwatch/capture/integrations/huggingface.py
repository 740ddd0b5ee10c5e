"""Hugging Face ``transformers.Trainer`` integration: ``StepwatchCallback``.

Importing this module imports transformers; it raises ``IntegrationUnavailable`` when
transformers is missing or older than 4.30. The Trainer's own callback events drive the
spans (spool-format-v1.md, "Canonical scope shape"), and transformers is the highest-priority
owner of epoch and step, so ``stepwatch.epochs``/``trace_step``/``batches`` in user code yield
to it while it trains::

    session
      epoch[n]                  on_epoch_begin .. on_epoch_end
        step[n]                 on_step_begin .. on_step_end (one optimizer step)
          data_load             the batches fetched for the step (torch patches)
          forward, backward, optimizer_step   (torch patches, summed onto the step)

``on_log`` values (loss, learning_rate, grad_norm, any other number) become marks on the step
they were logged for; the Trainer logs right after ``on_step_end``, so a step that will be
logged keeps its span open until ``on_log`` while its end time is taken at ``on_step_end``.
"""

from __future__ import annotations

from collections.abc import Mapping
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

__all__ = ["StepwatchCallback"]

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

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None) -> None:
        self._link = FrameworkLink(FRAMEWORK, init_kwargs)
        self._next_epoch = 0

    # TrainerCallback's events each take (args, state, control, **kwargs); None keeps `control`.

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.start()
        try:
            # A resumed run starts at its checkpoint's epoch.
            self._next_epoch = int((state.epoch or 0) + 1e-6)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.TRANSFORMERS_ON_TRAIN_BEGIN)
            self._next_epoch = 0

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.open_epoch(self._next_epoch)
        self._next_epoch += 1

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.close_epoch()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.open_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # DefaultFlowCallback runs first and sets should_log; when it is set, the Trainer's
        # `_maybe_log_save_evaluate` calls on_log next, before any other work of the loop.
        if getattr(control, "should_log", False):
            self._link.end_step_later()
        else:
            self._link.close_step()

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

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.settle()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.settle()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._link.stop()
