"""Named verdicts on a run: why its steps take the time they do, which rank holds the others
back, whether memory creeps. Pure: rows in, verdicts out (no I/O, no torch), deterministic.

INTERFACE SKELETON (session 17): the types and signatures below are the contract the surfaces
(final summary, ``explain``, live aggregator, ``compare``) code against; the engine fills the
bodies. docs/verdicts.md publishes every formula and threshold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DEFAULT_POLICY", "Diagnosis", "Severity", "Verdict", "VerdictPolicy", "diagnose"]

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


@dataclass(frozen=True)
class VerdictPolicy:
    """Thresholds and gates (TraceML 0.5.0's defaults); ``from_file`` and CLI flags override."""

    live_window_steps: int = 100


DEFAULT_POLICY = VerdictPolicy()


def diagnose(steps: Sequence[Mapping[str, Any]], memory: Sequence[Mapping[str, Any]] = (),
             system: Sequence[Mapping[str, Any]] = (), *, window: int | None = None,
             policy: VerdictPolicy = DEFAULT_POLICY) -> Diagnosis:
    """The verdicts on ``steps`` (rows of the history's ``steps`` table, every rank), ``memory``
    and ``system`` samples. ``window``: the last N steps completed on every rank (live), None: all."""
    primary = Verdict("INSUFFICIENT_STEP_TIME_DATA", "info", None, (), "not enough step data to say", None, {})
    return Diagnosis(primary)
