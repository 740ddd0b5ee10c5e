"""The framework callbacks attached by stepwatch itself, so that a script needs no change.

While stepwatch runs (``init`` with ``auto_instrument``, as under ``stepwatch run`` and
``stepwatch track``), every ``transformers.Trainer`` and ``lightning.pytorch.Trainer`` built gets
one ``StepwatchCallback``, unless the program gave it one already: the Trainer classes are
wrapped once their modules are imported, the way the torch patches wait for torch.

Why an import hook rather than a look at ``sys.modules`` at each tick: a Trainer is built
moments after its import, so a poll would miss the first one. ``capture/after_import`` runs the
wrapping the moment each module below finishes importing. Nothing here imports a framework: a
program that never imports one never loads it, and ``import stepwatch`` stays light.

Everything is reversible (``uninstall`` at shutdown restores the classes and removes the finder)
and fail-open: an error of ours is reported through ``report_internal`` and the Trainer is built
as if stepwatch were absent.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ...errors import IntegrationUnavailable
from ...guard import Site, report_internal
from ..after_import import finished, when_imported

__all__ = ["install", "installed", "integration_ready", "uninstall", "wrap_method"]

# The module whose import completes each framework's Trainer -> the integration that wraps it.
# ``lightning.pytorch`` (the package) rather than its trainer module: when the trainer module has
# run, the package (and ``lightning.pytorch.Callback``) is still half built.
TARGETS: dict[str, str] = {
    "transformers.trainer": "huggingface",
    "lightning.pytorch": "lightning",
}
_MARK = "__stepwatch_original__"

_lock = threading.RLock()
_cancels: list[Callable[[], None]] = []  # the import waits still pending (after_import)
_restores: list[Callable[[], None]] = []
_done: set[str] = set()  # targets wrapped (or found unusable) while installed: never twice
_waiting: dict[str, tuple[str, ModuleType]] = {}  # integration -> its target, while it imports the framework


def install() -> None:
    """Wraps the Trainers already imported, and the others as soon as they are. Idempotent."""
    with _lock:
        if _cancels:
            return
        for name in TARGETS:
            module = sys.modules.get(name)
            if finished(module):
                _instrument(name, module)  # type: ignore[arg-type]
            elif name not in _done:
                _cancels.append(when_imported(name, functools.partial(_imported, name)))


def uninstall() -> None:
    """Gives the Trainer classes back and stops waiting for their modules. Callbacks already
    attached stay on their Trainers, inert while stepwatch is stopped (they never start it
    themselves)."""
    with _lock:
        while _cancels:
            _cancels.pop()()
        _waiting.clear()
        while _restores:
            restore = _restores.pop()
            try:
                restore()
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.AUTOATTACH_RESTORE)
        _done.clear()


def installed() -> bool:
    """Whether a Trainer module is waited for or a Trainer class is wrapped."""
    with _lock:
        return bool(_cancels) or bool(_restores)


def _imported(name: str, module: ModuleType) -> None:
    """``after_import``'s call: ``name`` has just finished importing."""
    with _lock:
        if _cancels:  # not uninstalled meanwhile
            _instrument(name, module)


def integration_ready(integration: str) -> None:
    """An integration module's last line: when it was the one importing its framework (a program
    that imports ``stepwatch.capture.integrations.lightning`` before Lightning), the framework's
    import completed while the integration was half built, and the wrapping waited for this."""
    with _lock:
        waiting = _waiting.pop(integration, None)
        if waiting is not None and _cancels:
            _wrap(*waiting, sys.modules[f"{__package__}.{integration}"])


def _instrument(name: str, module: ModuleType) -> None:
    if name in _done:
        return
    _done.add(name)  # once, even when it fails: not again at every import
    qualified = f"{__package__}.{TARGETS[name]}"
    half_built = sys.modules.get(qualified)
    if half_built is not None and not finished(half_built):
        _waiting[TARGETS[name]] = (name, module)  # it imported the framework: integration_ready
        return
    try:
        integration = importlib.import_module(qualified)
    except IntegrationUnavailable:
        return  # a framework too old for its integration: its Trainer runs as it is
    except Exception as exc:  # noqa: BLE001
        _report(name, exc)
        return
    _wrap(name, module, integration)


def _wrap(name: str, module: ModuleType, integration: ModuleType) -> None:
    try:
        _restores.append(integration.instrument_trainer(module))
    except IntegrationUnavailable:
        pass  # a framework too old for its integration: its Trainer runs as it is
    except Exception as exc:  # noqa: BLE001
        _report(name, exc)


def _report(name: str, exc: Exception) -> None:
    if TARGETS[name] == "lightning":
        report_internal(exc, Site.AUTOATTACH_LIGHTNING)
    else:
        report_internal(exc, Site.AUTOATTACH_HUGGINGFACE)


def wrap_method(owner: type, name: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replaces ``owner.name`` (its own attribute) by ``make(original)``; returns the undo.

    A method the class does not define itself (an older release) is left alone: the undo does
    nothing then. A wrapper still in place from an earlier install is unwrapped first.
    """
    original = vars(owner).get(name)
    if original is None:
        return _nothing
    original = getattr(original, _MARK, original)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    setattr(owner, name, wrapper)

    def restore() -> None:
        if vars(owner).get(name) is wrapper:
            setattr(owner, name, original)

    return restore


def restore_all(restores: list[Callable[[], None]]) -> Callable[[], None]:
    """One undo for several ``wrap_method`` undos, last first."""

    def restore() -> None:
        for undo in reversed(restores):
            undo()

    return restore


def _nothing() -> None:
    return None
