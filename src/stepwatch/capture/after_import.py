"""Run a callback the moment a module's import completes, before the importing program's next
line: the torch patches (``torch_attach``) and the framework Trainers (``integrations.autoattach``)
wait for their modules this way.

Why an import hook rather than a look at ``sys.modules`` at the sampler's next tick: a program
starts stepping moments after ``import torch`` (and builds its Trainer moments after importing
it), so a poll misses the first steps. One finder first in ``sys.meta_path`` waits for the
module names asked for; every other import passes through it with one dict lookup. It finds a
waited-for module with the finders after it and shadows ``exec_module`` on that loader object,
for that one call: the callbacks run once the module's body has executed, while the import is
still in progress (``sys.modules`` holds the finished module). The finder leaves
``sys.meta_path`` when nothing is waited for any more.

Nothing here imports the module itself: a program that never imports it never loads it.
A callback's error is reported (``report_internal``) and the import goes on.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ..guard import Site, report_internal

__all__ = ["AfterImportFinder", "finished", "waiting", "when_imported"]

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_waiting: dict[str, list[Callback]] = {}
_finder: AfterImportFinder | None = None


def finished(module: ModuleType | None) -> bool:
    """A module whose body has run (not one found in ``sys.modules`` from inside its own import)."""
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def when_imported(name: str, callback: Callback) -> Callable[[], None]:
    """Calls ``callback(module)`` once, as soon as module ``name`` is imported; returns the undo
    (a no-op once the callback ran). A module already imported is not waited for: the caller
    looks at ``sys.modules`` first (a module still initializing there cannot be hooked any more;
    its caller's fallback takes it)."""
    global _finder
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if _finder is None:
            _finder = AfterImportFinder()
            sys.meta_path.insert(0, _finder)

    def cancel() -> None:
        with _lock:
            callbacks = _waiting.get(name)
            if callbacks is not None and callback in callbacks:
                callbacks.remove(callback)
                if not callbacks:
                    del _waiting[name]
            _leave_if_idle()

    return cancel


def waiting() -> frozenset[str]:
    """The module names a callback waits for."""
    with _lock:
        return frozenset(_waiting)


def _leave_if_idle() -> None:
    global _finder
    if _waiting or _finder is None:
        return
    finder, _finder = _finder, None
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def _run(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
        _leave_if_idle()
    for callback in callbacks:
        try:
            callback(module)
        except Exception as exc:  # noqa: BLE001 - the import goes on without us
            report_internal(exc, Site.AFTER_IMPORT_CALLBACK)


class AfterImportFinder:
    """Finds a waited-for module with the finders after it; its loader is the usual one, with
    ``exec_module`` shadowed on that loader object for that one call. (A meta path finder needs
    only ``find_spec``: ``importlib.abc`` would import ``importlib.resources`` into every rank.)"""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _waiting:
            return None
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or isinstance(finder, AfterImportFinder) or find is None:
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
                _run(fullname, module)

            loader.exec_module = exec_module
            return spec
        except Exception as exc:  # noqa: BLE001 - the import goes on without us
            report_internal(exc, Site.AFTER_IMPORT_FIND_SPEC)
            return None
