"""What the three tracker exports share: importing a tracker's package lazily, with one clear
error naming the extra that installs it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import IntegrationUnavailable, StepwatchError

__all__ = ["TrackerError", "require", "tracker_errors"]


class TrackerError(StepwatchError):
    """A tracker refused or failed the export (a tracking server down, a folder not writable):
    the CLI prints it as one ``error:`` line, exit code 2."""


@contextmanager
def tracker_errors(tracker: str) -> Iterator[None]:
    """Turns what a tracker's package raises (``MlflowException``, ``wandb.Error``, an ``OSError``
    from a writer) into one ``TrackerError`` line naming the tracker, its message on one line."""
    try:
        yield
    except StepwatchError:
        raise
    except Exception as exc:
        text = " ".join(str(exc).split())[:500] or type(exc).__name__
        raise TrackerError(f"{tracker} export failed: {type(exc).__name__}: {text}") from exc


def require(module: str, extra: str) -> Any:
    """``import module``, or ``IntegrationUnavailable`` saying ``pip install 'stepwatch[extra]'``
    (the CLI prints it as one ``error:`` line and exits 2). Imported here, at the export, so
    ``import stepwatch`` never pays for a tracker."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise IntegrationUnavailable(
            extra, f"not installed ({exc}); pip install 'stepwatch[{extra}]'") from None
