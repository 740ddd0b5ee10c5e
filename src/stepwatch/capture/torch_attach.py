"""When the torch patches go in: at once when torch is imported already, else the moment
``import torch`` completes (``after_import``), before the program's next line, so that its first
step is recorded like every other (a loop started right after ``import torch`` used to lose the
steps it made before the sampler's next tick). The sampler's tick still calls ``install`` while
no patches are in: the fallback for an import the hook did not see (another finder ahead of
ours, a torch already half imported when capture started).

One lock orders the two callers; the tick never acts on a torch still executing its
``__init__`` (it would wait on the import lock the training thread holds, while that thread,
the import done, waits on this lock).
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

from ..guard import Site, report_internal
from .after_import import finished, when_imported

__all__ = ["cancel", "install"]

_lock = threading.Lock()
_pending: dict[int, Any] = {}  # id(runtime) -> the undo of its wait for torch


def _complete(torch: ModuleType | None) -> bool:
    """torch with the parts the patches use (its import finished, or a stand-in built like it)."""
    return (torch is not None and hasattr(torch, "optim") and hasattr(getattr(torch, "utils", None), "data")
            and hasattr(torch, "cuda"))


def install(runtime: Any, torch: ModuleType | None = None) -> bool:
    """Installs ``runtime``'s torch patches (``runtime.patches``) once torch is fully imported;
    True once they are in. ``torch``: the module whose import just completed (the hook's call)."""
    with _lock:
        if runtime.patches is not None:
            return True
        if torch is None:
            found = sys.modules.get("torch")
            if not finished(found) or not _complete(found):
                if found is None and id(runtime) not in _pending:
                    _pending[id(runtime)] = when_imported("torch", lambda module: _imported(runtime, module))
                return False
        elif not _complete(torch):
            return False
        _drop(runtime)
        from .torch_patches import TorchPatches

        patches = TorchPatches(runtime.training)
        runtime.patches = patches  # set first: a failing install is not retried every tick
    patches.install()
    return True


def cancel(runtime: Any) -> None:
    """At stop: ``runtime`` no longer waits for torch."""
    with _lock:
        _drop(runtime)


def _drop(runtime: Any) -> None:
    undo = _pending.pop(id(runtime), None)
    if undo is not None:
        undo()


def _imported(runtime: Any, torch: ModuleType) -> None:
    if getattr(runtime, "_stopped", False):  # stopped meanwhile
        return
    try:
        install(runtime, torch)
    except Exception as exc:  # noqa: BLE001 - the program runs on without the patches
        report_internal(exc, Site.TORCH_ATTACH)
