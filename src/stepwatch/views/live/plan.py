"""The run's total steps, from the marks capture records in ``spool/`` batch files: a framework's
``max_steps`` (``stepwatch.plan``), else the epochs times the batches of the first loader the run
iterated (``stepwatch.dataloader``). Read only until the total is known."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec

from ..._decode import DECODE_FAILURES

__all__ = ["PlanReader"]

PLAN_MARK = "stepwatch.plan"  # the run's plan (epochs, max_steps), as capture records it
DATALOADER_MARK = "stepwatch.dataloader"  # capture/program_settings.py's: a loader's settings, ``batches`` among them
_EVERY_S = 2.0  # the spool is looked at this often while the total is unknown
_BATCH = re.compile(r"^\d{20}-.+\.json$")


class _Mark(msgspec.Struct):
    name: str | None = None
    value: Any = None
    attrs: dict[str, Any] | None = None


class _Batch(msgspec.Struct):
    marks: list[_Mark] = []


_batch_decoder = msgspec.json.Decoder(_Batch)


class PlanReader:
    """The plan's marks of one run directory's spool, each batch file read once."""

    def __init__(self, run_dir: Path) -> None:
        self.spool = run_dir / "spool"
        self._plan: dict[str, int] = {}
        self._seen: set[str] = set()
        self._read_at = 0.0

    def total(self, now: float) -> int | None:
        """The run's total steps (None: not known yet)."""
        if "total" not in self._plan and now - self._read_at >= _EVERY_S:
            self._read_at = now
            self._read()
        total = self._plan.get("total")
        if total is None:
            epochs, batches = self._plan.get("epochs"), self._plan.get("batches")
            if epochs and batches:
                total = epochs * batches
        return total

    def _read(self) -> None:
        try:
            names = sorted(e.name for e in os.scandir(self.spool) if _BATCH.match(e.name) and e.name not in self._seen)
        except OSError:
            return
        for name in names:
            self._seen.add(name)
            try:
                batch = _batch_decoder.decode((self.spool / name).read_bytes())
            except (OSError, *DECODE_FAILURES):
                continue
            for mark in batch.marks:
                attrs = mark.attrs or {}
                if mark.name == PLAN_MARK:
                    self._keep("total", attrs.get("max_steps"))
                    self._keep("epochs", attrs.get("epochs"))
                elif mark.name == DATALOADER_MARK and attrs.get("index") in (0, None):
                    self._keep("batches", attrs.get("batches"))

    def _keep(self, key: str, value: Any) -> None:
        """The first positive whole number a key is given: a later loader's or plan's never replaces it."""
        if key not in self._plan and type(value) is int and value > 0:
            self._plan[key] = value
