"""What a verdict is: a named finding with its severity, culprit ranks and the numbers behind it.

Kept apart from the rules so the surfaces (final summary, ``explain``, the live aggregator,
``compare``) and every rule module import the same two types without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["SEVERITY_RANK", "Diagnosis", "Severity", "Verdict"]

Severity = Literal["info", "warn", "crit"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warn": 1, "crit": 2}


@dataclass(frozen=True)
class Verdict:
    """One finding. ``ranks``: the ranks it is about (a straggler's slow ranks only; the ranks it
    held back go in ``evidence``). ``evidence``: the numbers, window and clock it was decided from."""

    name: str
    severity: Severity
    score: float | None
    ranks: tuple[int, ...]
    message: str
    next_step: str | None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "severity": self.severity, "score": self.score, "ranks": list(self.ranks),
                "message": self.message, "next_step": self.next_step, "evidence": dict(self.evidence)}


@dataclass(frozen=True)
class Diagnosis:
    """``primary``: the most severe step-time finding (else ``BALANCED`` or
    ``INSUFFICIENT_STEP_TIME_DATA``)."""

    primary: Verdict
    step_time: tuple[Verdict, ...] = ()
    memory: tuple[Verdict, ...] = ()
    system: tuple[Verdict, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"primary": self.primary.to_dict(), "step_time": [v.to_dict() for v in self.step_time],
                "memory": [v.to_dict() for v in self.memory], "system": [v.to_dict() for v in self.system]}

    def all(self) -> tuple[Verdict, ...]:
        """Every finding, step time first."""
        return (*self.step_time, *self.memory, *self.system)
