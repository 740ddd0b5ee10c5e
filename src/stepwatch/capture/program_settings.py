"""The settings a program's loaders, optimizers and copies really ran with, read from the
objects themselves (not guessed from the script's text), so that a verdict's advice can name
them: "num_workers is 2 on a 2-core machine".

Each is recorded once, as a ``summary`` mark on the session span (the channel user marks take
to the spool, the aggregator and the history's ``marks`` table; ``attrs`` holds the settings):

* ``stepwatch.dataloader``: at a loader's first ``__iter__``; value its class name;
* ``stepwatch.optimizer``: at an optimizer's first ``step()``; value its class name;
* ``stepwatch.h2d``: at the first host-to-device copy of each kind (``non_blocking`` or not);
  value ``"non_blocking"`` or ``"blocking"``;
* ``stepwatch.versions``: once, just before the first of the marks above (the process trains):
  the versions it trains with, ``torch``, ``cuda`` (the CUDA torch was built for; none on a CPU
  build), ``python``, ``stepwatch`` and ``platform``; value the torch version. A run started by
  ``stepwatch run`` has them only from here: its launcher never imports torch, so run.json's
  ``versions`` lack it. Not at the patches' install: a process that imports torch and never
  trains (a tool, a test) keeps the marks it made itself, and nothing;
* ``stepwatch.plan``: what the run will do, where the program says it: ``epochs`` (from
  ``stepwatch.epochs(n)``), ``max_steps`` (a framework's: Hugging Face's ``TrainerState.max_steps``,
  Lightning's estimated stepping batches); the live view's total is ``max_steps``, else
  ``epochs`` times the first loader's ``batches`` (``len(loader)``).

``analysis/program_settings.py`` reads them back per session and rank. Never raises into the
program: a setting that cannot be read is left out.
"""

from __future__ import annotations

import os
import platform
import threading
import weakref
from typing import Any

from ..artifacts.run_manifest import platform_text
from ..guard import Site, report_internal
from .spans import SpanRecorder

__all__ = ["DATALOADER_MARK", "H2D_MARK", "OPTIMIZER_MARK", "PLAN_MARK", "VERSIONS_MARK", "ProgramSettings",
           "dataloader_settings", "host_cpus", "optimizer_settings", "training_versions"]

DATALOADER_MARK = "stepwatch.dataloader"
OPTIMIZER_MARK = "stepwatch.optimizer"
H2D_MARK = "stepwatch.h2d"
PLAN_MARK = "stepwatch.plan"
VERSIONS_MARK = "stepwatch.versions"
_PLAIN = (bool, int, float, str, type(None))


def host_cpus() -> dict[str, int | None]:
    """The machine's CPU count and the CPUs this process may run on (its affinity)."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"host_cpus": os.cpu_count(), "usable_cpus": usable}


def _plain(value: Any) -> Any:
    return value if isinstance(value, _PLAIN) else type(value).__name__


def _class_name(obj: Any) -> str | None:
    return None if obj is None else type(obj).__qualname__


def dataloader_settings(loader: Any) -> dict[str, Any]:
    """What a ``DataLoader`` (or a subclass, or a wrapper with the same attributes) runs with."""
    settings: dict[str, Any] = {"class": _class_name(loader), "module": type(loader).__module__}
    for name in ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "drop_last",
                 "timeout", "in_order"):
        if hasattr(loader, name):
            settings[name] = _plain(getattr(loader, name))
    for name in ("sampler", "batch_sampler", "dataset"):
        settings[name] = _class_name(getattr(loader, name, None))
    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        settings["multiprocessing_context"] = getattr(context, "_name", None) or _class_name(context)
    dataset = getattr(loader, "dataset", None)
    try:
        settings["dataset_len"] = len(dataset)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - an IterableDataset, or a __len__ that fails: unknown
        settings["dataset_len"] = None
    try:
        settings["batches"] = len(loader)  # batches a pass yields: a plan's steps per epoch (the live view)
    except Exception:  # noqa: BLE001 - an iterable dataset's loader has no length
        settings["batches"] = None
    settings.update(host_cpus())
    return settings


def optimizer_settings(optimizer: Any) -> dict[str, Any]:
    """An optimizer's class, its fused/foreach choice, its groups and first learning rate, and
    where its parameters live (torch picks foreach for CUDA parameters when neither is set)."""
    groups = getattr(optimizer, "param_groups", None) or []
    first = groups[0] if groups else {}
    settings: dict[str, Any] = {"class": _class_name(optimizer), "module": type(optimizer).__module__,
                                "param_groups": len(groups)}
    for name in ("fused", "foreach", "capturable", "differentiable"):
        if name in first:
            settings[name] = _plain(first[name])
    lr = first.get("lr")
    try:
        settings["lr"] = float(lr) if lr is not None else None
    except (TypeError, ValueError):
        settings["lr"] = None
    params = first.get("params") or []
    settings["params"] = sum(len(g.get("params") or ()) for g in groups)
    settings["param_device"] = str(params[0].device.type) if params and hasattr(params[0], "device") else None
    return settings


def training_versions(torch: Any) -> dict[str, str | None]:
    """The versions a training process runs with (``torch``: the module its patches use)."""
    from .. import __version__

    version = getattr(torch, "version", None)
    return {"torch": str(getattr(torch, "__version__", "?")), "cuda": _text(getattr(version, "cuda", None)),
            "python": platform.python_version(), "stepwatch": __version__, "platform": platform_text()}


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


class ProgramSettings:
    """Records each loader's and optimizer's settings once, and the kinds of copies seen."""

    def __init__(self, recorder: SpanRecorder, torch: Any = None) -> None:
        self.recorder = recorder
        self.torch = torch  # the module the patches use: its versions go with the first settings
        self._versions_done = torch is None
        self._loaders: weakref.WeakSet[Any] = weakref.WeakSet()
        self._loader_ids: set[int] = set()  # loaders that cannot be weakly referenced
        self.h2d_seen: set[bool] = set()  # the non_blocking values of the copies recorded
        self._lock = threading.Lock()
        self._count = 0

    def _mark(self, name: str, value: str, attrs: dict[str, Any]) -> None:
        if not self._versions_done:
            with self._lock:
                first, self._versions_done = not self._versions_done, True
            if first:
                self.versions(self.torch)
        self.recorder.mark_on(self.recorder.session, name, value, "summary", attrs)

    def loader(self, loader: Any) -> None:
        """A loader's ``__iter__``: its settings, the first time it is iterated."""
        try:
            with self._lock:
                try:
                    if loader in self._loaders:
                        return
                    self._loaders.add(loader)
                except TypeError:
                    if id(loader) in self._loader_ids:
                        return
                    self._loader_ids.add(id(loader))
                index = self._count
                self._count += 1
            settings = dataloader_settings(loader)
            settings["index"] = index
            self._mark(DATALOADER_MARK, settings["class"] or "?", settings)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_SETTINGS)

    def optimizer(self, optimizer: Any) -> None:
        """An optimizer's first step."""
        try:
            settings = optimizer_settings(optimizer)
            self._mark(OPTIMIZER_MARK, settings["class"] or "?", settings)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_SETTINGS)

    def versions(self, torch: Any) -> None:
        """The versions mark (``_mark`` records it once, before the first settings mark)."""
        try:
            versions = training_versions(torch)
            self.recorder.mark_on(self.recorder.session, VERSIONS_MARK, versions["torch"], "summary", versions)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_SETTINGS)

    def h2d(self, tensor: Any, non_blocking: bool) -> None:
        """The first copy to the device of its kind (the caller checks ``h2d_seen`` first)."""
        try:
            self.h2d_seen.add(non_blocking)
            try:
                pinned: bool | None = bool(tensor.is_pinned())
            except Exception:  # noqa: BLE001 - cannot tell
                pinned = None
            self._mark(H2D_MARK, "non_blocking" if non_blocking else "blocking",
                       {"non_blocking": non_blocking, "source_pinned": pinned, "dtype": str(tensor.dtype)})
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.INFERRED_SETTINGS)
