"""Fail-open: stepwatch's own errors are logged once per site and swallowed, never raised into
user code. ``KeyboardInterrupt`` and ``SystemExit`` always pass (they are the user's).

Tests read ``swallowed()`` and fail on anything there, so a bug hidden by the guard still fails
the suite.

It sits at the top of the package, below capture and transport alike, so a transport module never
imports the training process's capture code to fail open. Every site a caller names is a member
of :class:`Site`: the counts and the once-only log line are keyed by it, so two places that picked
the same free-text name would share one count and hide each other's first error. ``@unique``
refuses a repeated name when this module is imported, and ``tests/structure/test_guard.py`` checks that
no member is named by two modules.
"""

from __future__ import annotations

import enum
import errno
import logging
import sys
import threading
import traceback
from collections import Counter
from typing import Any

__all__ = ["Site", "guarded", "logger", "report_internal", "reset_swallowed", "swallowed"]


@enum.unique
class Site(enum.StrEnum):
    """The named places that swallow an error, grouped by the module that owns them."""

    # capture/api.py
    INIT = "init"
    INIT_IDENTITY = "init.identity"
    # capture/phases.py
    PHASE_ENTER = "phase.enter"
    PHASE_EXIT = "phase.exit"
    # capture/runtime.py
    OOM_BUNDLE = "oom.bundle"
    DRAIN_PHASE = "drain.phase"
    DRAIN_PROGRESS = "drain.progress"
    SINK_APPEND = "sink.append"
    SINK_ENCODE = "sink.encode"
    SINK_FLUSH = "sink.flush"
    SPOOL_WRITE = "spool.write"
    STOP_HANDOFF = "stop.handoff"
    # capture/training.py
    TRACE_STEP_ENTER = "trace_step.enter"
    TRACE_STEP_EXIT = "trace_step.exit"
    SCOPE_ENTER = "scope.enter"
    SCOPE_EXIT = "scope.exit"
    MARK = "mark"
    EPOCHS = "epochs"
    EPOCHS_CLOSE = "epochs.close"
    BATCHES_FETCH = "batches.fetch"
    SNAPSHOT = "snapshot"
    INFERENCE = "inference"
    INFERENCE_ENTER = "inference.enter"
    INFERENCE_LEAVE = "inference.leave"
    # capture/torch_patches.py
    PATCH_FORWARD = "patch.forward"
    PATCH_FORWARD_END = "patch.forward.end"
    PATCH_BACKWARD = "patch.backward"
    PATCH_BACKWARD_END = "patch.backward.end"
    PATCH_OPTIMIZER = "patch.optimizer"
    PATCH_OPTIMIZER_END = "patch.optimizer.end"
    PATCH_DATA_LOAD = "patch.data_load"
    PATCH_DATA_LOAD_END = "patch.data_load.end"
    PATCH_DATA_LOAD_ITER = "patch.data_load.iter"
    PATCH_H2D = "patch.h2d"
    PATCH_H2D_END = "patch.h2d.end"
    # capture/integrations/__init__.py: FrameworkLink, one set per framework
    LIGHTNING_START = "lightning.start"
    LIGHTNING_STOP = "lightning.stop"
    LIGHTNING_OPEN_EPOCH = "lightning.open_epoch"
    LIGHTNING_CLOSE_EPOCH = "lightning.close_epoch"
    LIGHTNING_OPEN_STEP = "lightning.open_step"
    LIGHTNING_CLOSE_STEP = "lightning.close_step"
    LIGHTNING_MARK = "lightning.mark"
    TRANSFORMERS_START = "transformers.start"
    TRANSFORMERS_STOP = "transformers.stop"
    TRANSFORMERS_OPEN_EPOCH = "transformers.open_epoch"
    TRANSFORMERS_CLOSE_EPOCH = "transformers.close_epoch"
    TRANSFORMERS_OPEN_STEP = "transformers.open_step"
    TRANSFORMERS_CLOSE_STEP = "transformers.close_step"
    TRANSFORMERS_MARK = "transformers.mark"
    # capture/integrations/lightning.py
    LIGHTNING_ON_FIT_START = "lightning.on_fit_start"
    LIGHTNING_ON_TRAIN_EPOCH_START = "lightning.on_train_epoch_start"
    LIGHTNING_ON_TRAIN_EPOCH_END = "lightning.on_train_epoch_end"
    LIGHTNING_ON_BEFORE_OPTIMIZER_STEP = "lightning.on_before_optimizer_step"
    LIGHTNING_ON_TRAIN_BATCH_END = "lightning.on_train_batch_end"
    LIGHTNING_RESTORE = "lightning.restore"
    LIGHTNING_BATCH_TO_DEVICE = "lightning.batch_to_device"
    LIGHTNING_TRAINING_STEP = "lightning.training_step"
    LIGHTNING_TRAINING_STEP_LOSS = "lightning.training_step.loss"
    LIGHTNING_TRAINING_STEP_END = "lightning.training_step.end"
    # capture/integrations/huggingface.py
    TRANSFORMERS_ON_TRAIN_BEGIN = "transformers.on_train_begin"
    TRANSFORMERS_ON_LOG = "transformers.on_log"
    # transport/http_exporter.py
    HTTP_EXPORTER = "transport.http_exporter"
    # processes a training process starts, framework callbacks attached by themselves, eval steps
    INIT_CHILD = "init.child"
    CHILDREN_BOOTSTRAP = "children.bootstrap"
    AUTOATTACH_RESTORE = "autoattach.restore"
    AUTOATTACH_HUGGINGFACE = "autoattach.huggingface"
    AUTOATTACH_LIGHTNING = "autoattach.lightning"
    LIGHTNING_ATTACH = "lightning.attach"
    TRANSFORMERS_ATTACH = "transformers.attach"
    TRANSFORMERS_ADD_CALLBACK = "transformers.add_callback"
    TRANSFORMERS_GET_BATCH_SAMPLES = "transformers.get_batch_samples"
    TRANSFORMERS_PREDICTION_STEP = "transformers.prediction_step"
    LIGHTNING_OPEN_EVAL_STEP = "lightning.open_eval_step"
    LIGHTNING_CLOSE_EVAL_STEP = "lightning.close_eval_step"
    TRANSFORMERS_OPEN_EVAL_STEP = "transformers.open_eval_step"
    TRANSFORMERS_CLOSE_EVAL_STEP = "transformers.close_eval_step"
    LIGHTNING_STOP_FOR_HALT = "lightning.stop_for_halt"
    TRANSFORMERS_STOP_FOR_HALT = "transformers.stop_for_halt"
    PATCH_PROCESS_GROUP = "patch.process_group"
    PATCH_BARRIER = "patch.barrier"
    STEP_LEDGER_WRITE = "step_ledger.write"
    STEP_LEDGER_CREATE = "step_ledger.create"
    # capture/after_import.py, capture/torch_attach.py
    AFTER_IMPORT_FIND_SPEC = "after_import.find_spec"
    AFTER_IMPORT_CALLBACK = "after_import.callback"
    TORCH_ATTACH = "torch_attach.install"
    # capture/inferred_metrics.py: the loss and gradient norm with no code, the program's settings
    INFERRED_LOSS = "inferred.loss"
    INFERRED_GRAD_NORM = "inferred.grad_norm"
    INFERRED_RESOLVE = "inferred.resolve"
    INFERRED_SETTINGS = "inferred.settings"


logger = logging.getLogger("stepwatch.internal")
_lock = threading.Lock()
_seen_sites: set[str] = set()
_counts: Counter[str] = Counter()
_recent: list[BaseException] = []
_RECENT_MAX = 64
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # every write fails alike after the first: one site, one line


def report_internal(exc: BaseException, site: Site | None = None) -> None:
    """Counts a swallowed error and logs it the first time its site fails.

    Without a site (``with guarded:``) the raising line names it, so it cannot collide either.
    """
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        site = "the run directory (disk full: what cannot be written is counted as dropped)"  # type: ignore[assignment]
    elif site is None:
        tb = exc.__traceback__
        frames = traceback.extract_tb(tb) if tb is not None else []
        site = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else type(exc).__name__
    with _lock:
        _counts[site] += 1
        if len(_recent) < _RECENT_MAX:
            _recent.append(exc)
        first = site not in _seen_sites
        _seen_sites.add(site)
    if first:
        try:
            sys.stderr.write(f"[stepwatch] internal error at {site} (logged once, training continues): "
                             f"{type(exc).__name__}: {exc}\n")
            logger.debug("internal error at %s", site, exc_info=exc)
        except Exception:  # noqa: BLE001 - a closed stderr must not break the host either
            pass


class _Guard:
    """A shared, allocation-free context manager: ``with guarded: ...``."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        if typ is None or not issubclass(typ, Exception):
            return False
        report_internal(exc)
        return True


guarded = _Guard()


def swallowed() -> dict[str, int]:
    """Swallowed-error counts by site (also written into the run's records)."""
    with _lock:
        return dict(_counts)


def recent_swallowed() -> list[BaseException]:
    with _lock:
        return list(_recent)


def reset_swallowed() -> None:
    with _lock:
        _counts.clear()
        _seen_sites.clear()
        _recent.clear()
