"""What the three tracker exports share: importing a tracker's package lazily, with one clear
error naming the extra that installs it."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import IntegrationUnavailable

__all__ = ["require"]


def require(module: str, extra: str) -> Any:
    """``import module``, or ``IntegrationUnavailable`` saying ``pip install 'stepwatch[extra]'``
    (the CLI prints it as one ``error:`` line and exits 2). Imported here, at the export, so
    ``import stepwatch`` never pays for a tracker."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise IntegrationUnavailable(
            extra, f"not installed ({exc}); pip install 'stepwatch[{extra}]'") from None
