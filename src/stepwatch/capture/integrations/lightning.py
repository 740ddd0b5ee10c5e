"""Lightning (``lightning.pytorch.Trainer``) integration: ``StepwatchCallback``.

Importing this module imports Lightning; it raises ``IntegrationUnavailable`` when
``lightning`` is missing or older than 2.0 (the standalone ``pytorch_lightning`` package has
its own, different ``Callback`` class and is not supported). Lightning owns epoch and step
over plain-torch hooks and yields to transformers (spool-format-v1.md, "Canonical scope shape")::

    session
      epoch[n]                  on_train_epoch_start .. on_train_epoch_end
        step[n]                 from the batch's transfer to the device to on_train_batch_end
          data_load, h2d        (torch patches)
          forward               the LightningModule's training_step
          backward              (torch patches)
          optimizer_step        the optimizer's update, after the closure

One step is one optimizer step: with ``accumulate_grad_batches`` the span stays open over the
micro-batches of one update. Lightning runs ``training_step`` and ``backward`` inside
``optimizer.step(closure)``, after torch's optimizer pre-hooks have fired; left alone, the torch
patches would time the whole closure as ``optimizer_step``. With automatic optimization the
callback therefore times ``training_step`` as ``forward`` (the span the pre-hook opened is
renamed to it) and reopens ``optimizer_step`` at ``on_before_optimizer_step``, after the closure.
A ``stepwatch.mark`` made inside ``training_step`` so lands on that ``forward`` span, the
innermost open scope. With manual optimization the torch patches time each phase on their own
(the outermost module call is the forward).

Validation, test and prediction batches are ``eval_step``s (``on_<stage>_batch_start`` ..
``on_<stage>_batch_end``, from the batch's transfer to the device during a fit), under the epoch
they ran in; those of the sanity check carry ``sanity_check: true``.

Marks, on the step, at ``on_train_batch_end``: ``loss`` (training_step's output, one per
micro-batch), once per optimizer step ``learning_rate`` (each optimizer's param groups) and
``grad_norm`` (total L2 norm of the gradients before clipping, taken at
``on_before_optimizer_step``), and every numeric value in
``trainer.callback_metrics`` that changed since it was last marked; values still changing at
``on_train_epoch_end`` (epoch aggregates) are marked on the epoch. Reading a CUDA tensor's value
waits for the device, so these marks cost one synchronisation at the end of each step.

While stepwatch runs, ``instrument_trainer`` (applied by ``autoattach``) gives every Trainer
built without a ``StepwatchCallback`` one of its own (``auto_callback``); it stands aside when
the program adds its own later (``trainer.callbacks.append``, ``configure_callbacks``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ...errors import IntegrationUnavailable
from ...guard import Site, report_internal
from . import FrameworkLink, require_version

try:
    import lightning
    import torch
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - exercised by shadowing the module in tests
    raise IntegrationUnavailable("lightning", f"cannot be imported ({exc}); pip install lightning") from exc

require_version("lightning", getattr(lightning, "__version__", "0"), (2, 0))

__all__ = ["StepwatchCallback", "auto_callback", "instrument_trainer"]

FRAMEWORK = "lightning"
_OWN_MARKS = frozenset({"loss", "learning_rate", "grad_norm"})
_ORIGINAL = "__stepwatch_original__"


def _scalar(value: Any) -> Any:
    """``value`` when it is a number or a one-element tensor, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    return None


def _loss_of(output: Any) -> Any:
    """The loss in what ``training_step`` returned (a tensor, or a mapping with ``"loss"``)."""
    return _scalar(output.get("loss") if isinstance(output, Mapping) else output)


def _same(previous: Any, value: Any) -> bool:
    if previous is value:
        return True
    if isinstance(previous, torch.Tensor) and isinstance(value, torch.Tensor):
        return (previous.device == value.device and previous.numel() == value.numel() == 1
                and previous.data_ptr() == value.data_ptr() and previous._version == value._version)
    return False


def _total_grad_norm(optimizer: Any) -> Any:
    """Total L2 norm of the optimizer's gradients as a 0-d tensor (no device sync), or None."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: foreach kernels
    if total_norm is not None:
        return total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), 2.0) for g in grads]), 2.0)


class StepwatchCallback(Callback):
    """Records a ``lightning.pytorch.Trainer`` fit: epochs, optimizer steps, and metrics.

    Starts stepwatch at ``on_fit_start`` when it is not running (with ``init_kwargs``), and then
    also shuts it down at ``on_train_end``; a stepwatch the program started is left running.
    Never raises into the Trainer; the user's exceptions pass through unchanged.

    Example::

        stepwatch.init(out="runs/resnet")
        trainer = lightning.pytorch.Trainer(max_epochs=3, callbacks=[StepwatchCallback()])
        trainer.fit(model, loader)
        stepwatch.shutdown()

    Args:
        init_kwargs: options for ``stepwatch.init`` when the callback starts stepwatch itself.

    Raises:
        ConfigError: ``init_kwargs`` holds an invalid option (raised here, not during training).
    """

    auto_attached = False  # True on the one stepwatch attached by itself (``auto_callback``)

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._link = FrameworkLink(FRAMEWORK, init_kwargs)
        self._inert = False  # an auto-attached callback next to the program's own: it stands aside
        self._patched: list[tuple[Any, str, bool, Any]] = []  # (owner, name, had own attr, previous)
        self._stepped = False  # an optimizer step happened in this batch
        self._optimizer_moved = False  # the pre-hook's span became forward: reopen optimizer_step
        self._grad_norms: list[tuple[int | None, Any]] = []
        self._metrics_seen: dict[str, Any] = {}
        self._loss: Any = None  # training_step's own loss, before Lightning divides it for accumulation

    # -- fit ----------------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._inert = self.auto_attached and _has_own_callback(trainer)
        # Claimed before the sanity check, so its batches are eval steps of the framework.
        if self._inert or self._link.start() is None:
            return
        try:
            self._metrics_seen.clear()
            # Both wrappers sit on the trainer's strategy, which Lightning calls for these two
            # hooks; the user's module is never patched (it stays picklable, as the user built it).
            strategy = trainer.strategy
            self._patch(strategy, "batch_to_device", self._wrap_batch_to_device(trainer))
            if getattr(pl_module, "automatic_optimization", True):
                # with manual optimization training_step also runs backward and the optimizer:
                # then the torch patches time each phase on their own.
                self._patch(strategy, "training_step", self._wrap_training_step())
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.LIGHTNING_ON_FIT_START)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._inert:
            self._link.start()  # idempotent: the same claim as on_fit_start
            self._link.plan(max_steps=_stepping_batches(trainer), epochs=getattr(trainer, "max_epochs", None))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._restore()
        self._link.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning re-raises `exception` after its callbacks ran: close what we opened, flagged.
        self._restore()
        self._link.stop(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restore()
        if stage == "fit":
            self._link.stop()  # a fit that ended without on_train_end: nothing of ours stays open

    # -- epochs -------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        try:
            index = int(trainer.current_epoch)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.LIGHTNING_ON_TRAIN_EPOCH_START)
            return
        self._link.open_epoch(index)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        link = self._link
        link.close_step()  # an accumulation group cut short by the end of the epoch
        if link.owns() is not None:
            try:
                self._mark_metrics(trainer, set(), step=int(trainer.global_step))
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.LIGHTNING_ON_TRAIN_EPOCH_END)
        link.close_epoch()

    # -- steps --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._link.open_step()  # usually open already, since the batch's transfer to the device
        self._stepped = False
        self._loss = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        link = self._link
        state = link.owns()
        if state is None:
            return
        try:
            self._stepped = True
            norm = _total_grad_norm(optimizer)
            if norm is not None:
                index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), None)
                self._grad_norms.append((index, norm))
            if self._optimizer_moved:
                self._optimizer_moved = False
                local = state.local
                if local.optimizer_token is None:
                    # torch's post-hook ends this one, as it would have ended the pre-hook's.
                    local.optimizer_token = state.begin_phase("optimizer_step")
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.LIGHTNING_ON_BEFORE_OPTIMIZER_STEP)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        link = self._link
        if link.owns() is None:
            return
        try:
            global_step = int(trainer.global_step)
            marked = set()
            loss, self._loss = self._loss, None
            if loss is None:
                loss = _loss_of(outputs)
            if loss is not None:
                link.mark("loss", loss, step=global_step)
                marked.add("loss")
            norms, self._grad_norms = self._grad_norms, []
            for index, norm in norms:
                extra = {"optimizer": index} if len(norms) > 1 and index is not None else {}
                link.mark("grad_norm", norm, step=global_step, **extra)
                marked.add("grad_norm")
            manual = not getattr(pl_module, "automatic_optimization", True)
            # one learning rate per optimizer step, not one per accumulated micro-batch
            optimizers = list(trainer.optimizers) if manual or self._stepped else []
            for i, optimizer in enumerate(optimizers):
                groups = optimizer.param_groups
                for j, group in enumerate(groups):
                    lr = _scalar(group.get("lr"))
                    if lr is None:
                        continue
                    extra = {}
                    if len(optimizers) > 1:
                        extra["optimizer"] = i
                    if len(groups) > 1:
                        extra["param_group"] = j
                    link.mark("learning_rate", lr, step=global_step, **extra)
                    marked.add("learning_rate")
            self._mark_metrics(trainer, marked, step=global_step)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.LIGHTNING_ON_TRAIN_BATCH_END)
        if not getattr(pl_module, "automatic_optimization", True) or self._stepped:
            link.close_step()  # else gradients accumulate: the step goes on with the next batch
            # a ``stepwatch halt`` step done: Lightning's own stop, unless min_steps/min_epochs
            # would make it train on (then the Halt at the next phase stops it)
            if link.stop_for_halt(lambda: bool(getattr(trainer.fit_loop, "_can_stop_early", False))):
                trainer.should_stop = True

    # -- evaluation steps (validation, test, prediction) ----------------------------------------

    def _open_eval(self, trainer: Any) -> None:
        span = self._link.eval_step
        if self._inert or (span is not None and not span.closed):
            return  # opened already, before the batch's transfer to the device
        try:
            sanity = bool(trainer.sanity_checking)
        except Exception:  # noqa: BLE001 - a Trainer without the flag: not a sanity check
            sanity = False
        self._link.open_eval_step(**({"sanity_check": True} if sanity else {}))

    def _close_eval(self) -> None:
        self._link.close_eval_step()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._open_eval(trainer)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._close_eval()

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._open_eval(trainer)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._close_eval()

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        self._open_eval(trainer)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._close_eval()

    def _mark_metrics(self, trainer: Any, marked: set[str], **attrs: Any) -> None:
        """Marks each numeric ``callback_metrics`` value that is new since the last call.

        Lightning keeps stale values in the dict and hands out a fresh ``detach()`` of the same
        tensor on each read, so "new" means new storage: the previous tensor is kept alive here,
        hence its memory cannot be reused and an equal ``data_ptr`` is the same value.
        """
        seen = self._metrics_seen
        for name, value in trainer.callback_metrics.items():
            if _same(seen.get(name), value):
                continue
            seen[name] = value
            if name in marked or name in _OWN_MARKS:
                continue
            number = _scalar(value)
            if number is not None:
                self._link.mark(name, number, **attrs)

    # -- reversible wrappers ---------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        current = getattr(owner, name)
        if getattr(current, _ORIGINAL, None) is not None:
            return  # wrapped already (a second fit with the same callback)
        functools.update_wrapper(wrapper, current)
        setattr(wrapper, _ORIGINAL, current)
        had = name in vars(owner)
        previous = vars(owner).get(name)
        setattr(owner, name, wrapper)
        self._patched.append((owner, name, had, previous))

    def _restore(self) -> None:
        try:
            while self._patched:
                owner, name, had, previous = self._patched.pop()
                if had:
                    setattr(owner, name, previous)
                elif name in vars(owner):
                    delattr(owner, name)
            self._optimizer_moved = False
            self._grad_norms = []
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.LIGHTNING_RESTORE)

    def _wrap_batch_to_device(self, trainer: Any) -> Any:
        """The step opens before the batch moves to the device, so ``h2d`` is inside it
        (Lightning transfers the batch before ``on_train_batch_start``)."""
        link = self._link
        original = trainer.strategy.batch_to_device

        def batch_to_device(*args: Any, **kwargs: Any) -> Any:
            try:
                if trainer.training and not trainer.sanity_checking:
                    link.open_step()
                elif trainer.sanity_checking or trainer.validating or trainer.testing or trainer.predicting:
                    self._open_eval(trainer)  # the eval step opens before its batch's transfer too
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.LIGHTNING_BATCH_TO_DEVICE)
            return original(*args, **kwargs)

        return batch_to_device

    def _wrap_training_step(self) -> Any:
        """``Strategy.training_step`` (the LightningModule's ``training_step``, through a DDP
        wrapper where there is one) timed as the ``forward`` phase; module calls inside it are
        not timed again."""
        callback = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            original = getattr(training_step, _ORIGINAL)
            begun = None
            try:
                begun = callback._begin_forward()
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.LIGHTNING_TRAINING_STEP)
            if begun is None:
                return original(*args, **kwargs)
            state, span = begun
            try:
                output = original(*args, **kwargs)  # the user's errors pass through untouched
                try:
                    callback._loss = _loss_of(output)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, Site.LIGHTNING_TRAINING_STEP_LOSS)
                return output
            finally:
                state.local.in_forward = False
                try:
                    state.end_phase(span)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, Site.LIGHTNING_TRAINING_STEP_END)

        return training_step

    def _begin_forward(self) -> tuple[Any, Any] | None:
        link = self._link
        state = link.owns()
        if state is None or link.step is None or link.step.closed:
            return None
        local = state.local
        if local.in_forward:
            return None  # called through a wrapper module (DDP) whose call is the forward
        pending = local.optimizer_token
        if (pending is not None and pending.name == "optimizer_step" and not pending.closed
                and state.recorder.current() is pending):
            # optimizer.step(closure) ran torch's pre-hook just before this closure: what that
            # span times is this training_step, so it becomes the forward, and the optimizer's
            # own update gets a new span at on_before_optimizer_step.
            local.optimizer_token = None
            pending.name = "forward"
            span = pending
            self._optimizer_moved = True
        else:
            span = state.begin_phase("forward")
        local.in_forward = True
        return state, span


def auto_callback() -> StepwatchCallback:
    """The callback stepwatch attaches to a Trainer built without one: it drives the fits while
    stepwatch runs, and never starts stepwatch itself."""
    callback = StepwatchCallback()
    callback.auto_attached = True
    callback._link.start_runtime = False
    return callback


def _has_own_callback(trainer: Any) -> bool:
    """The program put a ``StepwatchCallback`` of its own on ``trainer``."""
    return any(isinstance(c, StepwatchCallback) and not c.auto_attached for c in trainer.callbacks)


def instrument_trainer(module: ModuleType) -> Callable[[], None]:
    """Wraps ``module.Trainer`` (``lightning.pytorch``) so that every Trainer built gets a
    ``StepwatchCallback`` unless it was given one; returns the undo. A model's
    ``configure_callbacks`` returning one replaces it at fit (Lightning's rule for callbacks of
    the same type)."""
    from .autoattach import wrap_method

    def wrap_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                callbacks = self.callbacks
                if not any(isinstance(c, StepwatchCallback) for c in callbacks):
                    callbacks.append(auto_callback())
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.LIGHTNING_ATTACH)

        return __init__

    return wrap_method(module.Trainer, "__init__", wrap_init)


def _stepping_batches(trainer: Any) -> Any:
    """The optimizer steps ``fit`` will take (Lightning's estimate: ``max_steps``, else epochs
    times batches), None where it cannot tell; never raises (the property may)."""
    try:
        return trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - an unsized loader, a strategy that cannot say
        return None


# last: a Trainer whose import waited on this module (it imported the framework itself) is wrapped now
from .autoattach import integration_ready  # noqa: E402

integration_ready("lightning")
