"""The framework callbacks attached by stepwatch itself, so that a script needs no change.

While stepwatch runs (``init`` with ``auto_instrument``, as under ``stepwatch run`` and
``stepwatch track``), every ``transformers.Trainer`` and ``lightning.pytorch.Trainer`` built gets
one ``StepwatchCallback``, unless the program gave it one already: the Trainer classes are
wrapped once their modules are imported, the way the torch patches wait for torch.

Why an import hook rather than a look at ``sys.modules`` at each tick: a Trainer is built
moments after its import, so a poll would miss the first one. A finder first in
``sys.meta_path`` waits for the two module names below; the rest of the imports pass through it
with one dict lookup. Nothing here imports a framework: a program that never imports one never
loads it, and ``import stepwatch`` stays light.

Everything is reversible (``uninstall`` at shutdown restores the classes and removes the finder)
and fail-open: an error of ours is reported through ``report_internal`` and the Trainer is built
as if stepwatch were absent.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ...errors import IntegrationUnavailable
from ...guard import Site, report_internal

__all__ = ["install", "installed", "uninstall", "wrap_method"]

# The module whose import completes each framework's Trainer -> the integration that wraps it.
# ``lightning.pytorch`` (the package) rather than its trainer module: when the trainer module has
# run, the package (and ``lightning.pytorch.Callback``) is still half built.
TARGETS: dict[str, str] = {
    "transformers.trainer": "huggingface",
    "lightning.pytorch": "lightning",
}
_MARK = "__stepwatch_original__"

_lock = threading.RLock()
_finder: _ImportHook | None = None
_restores: list[Callable[[], None]] = []
_done: set[str] = set()  # targets wrapped (or found unusable) while installed: never twice


def install() -> None:
    """Wraps the Trainers already imported, and the others as soon as they are. Idempotent."""
    global _finder
    with _lock:
        for name in TARGETS:
            module = sys.modules.get(name)
            if module is not None and not _initializing(module):
                _instrument(name, module)
        if _finder is None and len(_done) < len(TARGETS):
            _finder = _ImportHook()
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Gives the Trainer classes back and removes the finder. Callbacks already attached stay
    on their Trainers, inert while stepwatch is stopped (they never start it themselves)."""
    global _finder
    with _lock:
        finder, _finder = _finder, None
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        while _restores:
            restore = _restores.pop()
            try:
                restore()
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.AUTOATTACH_RESTORE)
        _done.clear()


def installed() -> bool:
    """Whether the finder waits for a Trainer module or a Trainer class is wrapped."""
    with _lock:
        return _finder is not None or bool(_restores)


def _initializing(module: ModuleType) -> bool:
    """A module still executing (found in ``sys.modules`` from inside its own import)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _instrument(name: str, module: ModuleType) -> None:
    if name in _done:
        return
    _done.add(name)  # once, even when it fails: not again at every import
    try:
        integration = importlib.import_module(f"{__package__}.{TARGETS[name]}")
        _restores.append(integration.instrument_trainer(module))
    except IntegrationUnavailable:
        pass  # a framework too old for its integration: its Trainer runs as it is
    except Exception as exc:  # noqa: BLE001
        if TARGETS[name] == "lightning":
            report_internal(exc, Site.AUTOATTACH_LIGHTNING)
        else:
            report_internal(exc, Site.AUTOATTACH_HUGGINGFACE)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds a target module with the finders after it, and runs ``_instrument`` once the
    module has executed. Its loader is the usual one: only its ``exec_module`` is shadowed, on
    that loader object, for that one call."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in TARGETS or fullname in _done:
            return None
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or isinstance(finder, _ImportHook) or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            loader = getattr(spec, "loader", None)
            if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
                return None  # a builtin or frozen module, a namespace package: imported as usual
            original = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                if module.__name__ != fullname:  # a loader shared with another module
                    original(module)
                    return
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
                original(module)  # the module's own errors are the import's
                with _lock:
                    if _finder is not None:  # not uninstalled meanwhile
                        _instrument(fullname, module)

            loader.exec_module = exec_module
            return spec
        except Exception as exc:  # noqa: BLE001 - the import goes on without us
            report_internal(exc, Site.AUTOATTACH_FIND_SPEC)
            return None


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
