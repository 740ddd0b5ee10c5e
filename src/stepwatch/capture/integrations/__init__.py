"""Framework integrations: one self-gating module per training library.

``stepwatch.capture.integrations.huggingface`` (``transformers.Trainer``) and
``stepwatch.capture.integrations.lightning`` (``lightning.pytorch.Trainer``) import their library
at the top and raise ``IntegrationUnavailable`` when it is missing or too old; nothing else in
stepwatch imports them, so ``import stepwatch`` stays light.

What the callbacks share lives here: ``FrameworkLink`` claims epoch/step ownership for its
framework (spool-format-v1.md, "Canonical scope shape": transformers > lightning > torch, the
others yield), starts stepwatch when nobody did, and opens and closes the ``epoch`` and ``step``
spans through the ``TrainingState``, so phase times from the torch patches are summed onto the
steps exactly as under ``trace_step``; evaluation batches are ``eval_step``s. Every method is
fail-open: errors are reported through ``report_internal`` and swallowed, never raised into the
trainer.

``autoattach`` (installed by ``stepwatch.init``, removed at shutdown) attaches a callback to every
Trainer built while stepwatch runs, so that a script needs no change (docs/frameworks.md).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import IntegrationUnavailable
from ...guard import Site, report_internal
from .. import training
from ..spans import OpenSpan
from ..training import TrainingState

__all__ = ["FrameworkLink", "require_version", "validate_init_kwargs"]

# The guard sites of each framework's link, looked up once here so that a framework without its
# declared ``Site`` members fails at import, never inside an error handler in the trainer.
_LINK_OPERATIONS = ("start", "stop", "open_epoch", "close_epoch", "open_step", "close_step", "mark", "open_eval_step",
                    "close_eval_step", "stop_for_halt")
_SITES: dict[str, dict[str, Site]] = {
    framework: {op: Site(f"{framework}.{op}") for op in _LINK_OPERATIONS}
    for framework in ("lightning", "transformers")
}


def require_version(library: str, version: str, minimum: tuple[int, ...]) -> None:
    """Raises ``IntegrationUnavailable`` when ``version`` (``"4.57.1"``, ``"2.6.0rc1"``) is below
    ``minimum``; a version that cannot be parsed is accepted."""
    parts = []
    for piece in str(version).split(".")[: len(minimum)]:
        match = re.match(r"\d+", piece)
        if match is None:
            return
        parts.append(int(match.group()))
    if tuple(parts) < minimum:
        wanted = ".".join(map(str, minimum))
        raise IntegrationUnavailable(library, f"version {version} is too old; stepwatch needs {library}>={wanted}")


def validate_init_kwargs(init_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options a callback passes to ``stepwatch.init``, checked now so that a typo raises
    ``ConfigError`` where the callback is built, not inside the trainer."""
    from ..config import RuntimeConfig

    kwargs = dict(init_kwargs or {})
    options = {k: v for k, v in kwargs.items() if k != "enabled"}
    if options.get("out") is not None:
        options["out"] = os.fspath(options["out"])
    RuntimeConfig.from_env({}, **options)  # raises ConfigError; the environment is read at init
    return kwargs


class FrameworkLink:
    """One callback's hold on the running stepwatch: its claim, the epoch and step it opened,
    and whether it started stepwatch itself (then it also stops it).

    Example::

        link = FrameworkLink("lightning", init_kwargs=None)
        link.start()                 # train begins: init if needed, claim epoch/step
        link.open_epoch(0); link.open_step()
        ...                          # torch patches time forward / backward / optimizer_step
        link.mark("loss", 0.25, step=1)
        link.close_step(); link.close_epoch()
        link.stop()                  # train ends: close leftovers, release, shut down if ours
    """

    __slots__ = ("framework", "sites", "init_kwargs", "start_runtime", "state", "started", "epoch", "step",
                 "step_end_ns", "eval_step", "halted")

    def __init__(self, framework: str, init_kwargs: Mapping[str, Any] | None = None, *,
                 start_runtime: bool = True) -> None:
        self.framework = framework
        self.sites = _SITES[framework]  # KeyError for a framework with no declared sites
        self.init_kwargs = validate_init_kwargs(init_kwargs)
        # False for the callback stepwatch attached itself: it works while stepwatch runs and
        # never starts it (a program that stopped stepwatch wants it stopped).
        self.start_runtime = start_runtime
        self.state: TrainingState | None = None  # the state the open spans belong to
        self.started: Any = None  # the runtime this link started, to stop only that one
        self.epoch: OpenSpan | None = None
        self.step: OpenSpan | None = None
        self.step_end_ns: int | None = None  # a step that ended but waits for its logs
        self.eval_step: OpenSpan | None = None
        self.halted: Any = None  # the runtime whose halt this link left to the framework's stop flag

    # -- lifecycle ----------------------------------------------------------------------------

    def current(self) -> TrainingState | None:
        """The active ``TrainingState`` when it is the one this link started with, else None
        (stepwatch was shut down or restarted under us: nothing of ours is open there)."""
        state = training._state
        if state is None or state is not self.state:
            return None
        return state

    def start(self) -> TrainingState | None:
        """Starts stepwatch unless it runs, then claims epoch and step for the framework."""
        try:
            from ..api import current_runtime, init

            if not current_runtime().active:
                if not self.start_runtime:
                    return None
                runtime = init(**self.init_kwargs)
                self.started = runtime if runtime.active else None
            state = training._state
            if state is not self.state:
                self.state, self.epoch, self.step, self.step_end_ns = state, None, None, None
            else:
                self._close_leftovers()
            if state is not None:
                state.claim(self.framework)
            return state
        except Exception as exc:  # noqa: BLE001 - start-up failed: the trainer runs on without us
            report_internal(exc, self.sites["start"])
            return None

    def stop(self, error: BaseException | None = None) -> None:
        """Closes what this link has open, gives up the claim, and shuts stepwatch down if this
        link started it (and only then, and only on a clean end)."""
        try:
            self.close_eval_step(error)  # also one opened outside a fit (trainer.validate())
            state = self.current()
            if state is not None:
                self.close_step(error)
                self.close_epoch(error)
                # Ownership lasts while the framework's loop runs; a plain torch loop after it
                # marks its own steps again.
                state.release(self.framework)
            self.state, self.epoch, self.step, self.step_end_ns = None, None, None, None
            started, self.started = self.started, None
            if started is not None and error is None:
                from ..api import current_runtime, shutdown

                if current_runtime() is started:
                    shutdown()
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["stop"])

    def _close_leftovers(self) -> None:
        """A previous run of this callback ended without its end event (the Trainer raised and
        transformers has no exception event): its spans close now, flagged like at shutdown."""
        for span in (self.step, self.epoch):
            if span is not None and not span.closed:
                span.attrs = {**(span.attrs or {}), "unclosed": True}
        self.settle()
        self.close_step()
        self.close_epoch()

    def owns(self) -> TrainingState | None:
        """The state, when this framework may open epochs and steps in it (nobody above it claimed)."""
        state = self.current()
        if state is None or state.yields(self.framework):
            return None
        return state

    # -- epochs -------------------------------------------------------------------------------

    def open_epoch(self, index: int) -> None:
        try:
            state = self.owns()
            if state is None:
                return
            self.settle()
            self.close_step()
            if self.epoch is not None and not self.epoch.closed:
                state.recorder.close(self.epoch)
            foreign = state.epoch
            if foreign is not None and not foreign.closed and foreign is not self.epoch:
                # An epoch a lower-priority hook opened before this framework claimed ownership
                # (``for _ in stepwatch.epochs(1): trainer.train()``): take it over as this
                # epoch rather than close it and open a duplicate (spool-format-v1.md).
                foreign.index = index
                self.epoch = foreign
            else:
                self.epoch = state.open_epoch(index)
            if self.epoch is not None:
                self.epoch.attrs = {**(self.epoch.attrs or {}), "framework": self.framework}
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["open_epoch"])

    def close_epoch(self, error: BaseException | None = None) -> None:
        try:
            state = self.current()
            epoch, self.epoch = self.epoch, None
            if state is None or epoch is None or epoch.closed:
                return
            self.settle()
            self.close_step(error)
            if error is not None:
                epoch.attrs = {**(epoch.attrs or {}), "error": type(error).__name__}
            state.recorder.close(epoch)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["close_epoch"])

    # -- steps --------------------------------------------------------------------------------

    def open_step(self) -> OpenSpan | None:
        """Opens this framework's step unless one of ours is open already (gradient accumulation)
        or a higher-priority framework owns steps."""
        try:
            state = self.owns()
            if state is None:
                return None
            if self.halted is not None:  # told to stop at the halt step, the framework trains on
                runtime, self.halted = self.halted, None
                runtime.raise_halt()  # Halt, as for a plain loop: the rank must not pass that step
            self.settle()
            local = state.local
            if self.step is not None and local.step is self.step:
                return self.step
            if local.step is not None and not local.implicit:
                return None  # a step someone opened before the claim: never nest steps
            # model=None: the outermost module call in the step is its forward, whatever wraps
            # the model (DDP, torch.compile, accelerate); loss modules are still skipped.
            self.step = state.open_step(None, {"framework": self.framework})
            self.step_end_ns = None
            return self.step
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["open_step"])
            return None

    def close_step(self, error: BaseException | None = None, *, end_ns: int | None = None) -> None:
        try:
            step, self.step = self.step, None
            end_ns = end_ns or self.step_end_ns
            self.step_end_ns = None
            state = self.current()
            if state is not None and step is not None and not step.closed:
                state.close_step(step, error, end_ns=end_ns)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["close_step"])

    def stop_for_halt(self, can_stop: Callable[[], bool] = lambda: True) -> bool:
        """True once this rank has completed the step a ``stepwatch halt`` named (docs/halt.md)
        and ``can_stop()`` says the framework will honour its own stop flag now: the callback then
        sets that flag, and stepwatch no longer raises ``Halt`` at the next phase, so the fit ends
        the framework's way (its end-of-training hooks run, ``fit`` returns); should it open
        another training step all the same, ``open_step`` raises ``Halt``. Every rank completes
        the same step, so every rank stops there."""
        try:
            from ..api import current_runtime

            runtime = current_runtime()
            if runtime.halt_step is None or self.owns() is None or not runtime.halt_reached_here() or not can_stop():
                return False
            runtime.leave_halt_to_caller()
            self.halted = runtime
            return True
        except Exception as exc:  # noqa: BLE001 - the Halt at the next phase still stops the rank
            report_internal(exc, self.sites["stop_for_halt"])
            return False

    def end_step_later(self) -> None:
        """The step ended now, but the framework logs its values right after: keep the span open
        for those marks (so they count in its ``mark_ids``) and close it at ``settle``."""
        if self.step is not None:
            self.step_end_ns = time.time_ns()

    def settle(self) -> None:
        """Closes a step that ended earlier and was kept open for its logs."""
        if self.step_end_ns is not None:
            self.close_step()

    # -- evaluation steps -----------------------------------------------------------------------

    def open_eval_step(self, **attrs: Any) -> OpenSpan | None:
        """Opens an ``eval_step`` for one evaluation batch (validation, test, prediction), also
        outside a fit (``trainer.evaluate()`` on its own), unless a step is open already.

        Opened as an inferred step: forward only, it closes as an ``eval_step`` with its own
        index, kept out of the step statistics, its batch's fetch and phases inside it.
        """
        try:
            state = self.current() or training._state
            if state is None or state.yields(self.framework):
                return None
            if state is self.state:
                self.settle()
            if state.local.step is not None:
                return None  # inside a step (an evaluation the user runs inside a training step)
            self.eval_step = state.open_step(None, {"framework": self.framework, **attrs}, implicit=True)
            return self.eval_step
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["open_eval_step"])
            return None

    def close_eval_step(self, error: BaseException | None = None) -> None:
        try:
            span, self.eval_step = self.eval_step, None
            state = training._state
            if state is not None and span is not None and not span.closed:
                state.close_step(span, error)  # a no-op when something else closed it already
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["close_eval_step"])

    # -- marks --------------------------------------------------------------------------------

    def plan(self, max_steps: Any = None, epochs: Any = None) -> None:
        """The framework's plan as a ``stepwatch.plan`` summary mark on the session (once per
        start): the steps (``max_steps``) and epochs it will run, whichever it knows (positive
        integers only: Lightning says ``inf`` or -1 for unbounded)."""
        try:
            state = self.current() or training._state
            if state is None:
                return
            from ..program_settings import PLAN_MARK

            attrs = {key: int(value) for key, value in (("max_steps", max_steps), ("epochs", epochs))
                     if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 2**62
                     and value == int(value)}
            if attrs:
                state.recorder.mark(PLAN_MARK, attrs.get("max_steps", attrs.get("epochs")), "summary", attrs)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["mark"])

    def mark(self, name: str, value: Any, **attrs: Any) -> None:
        """A point mark on this link's open step, else on the innermost open span."""
        try:
            state = self.current() or training._state
            if state is None:
                return
            step = self.step if self.step is not None and not self.step.closed and state is self.state else None
            target = step if step is not None else state.recorder.current()
            state.recorder.mark_on(target, name, value, "point", attrs or None)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, self.sites["mark"])
