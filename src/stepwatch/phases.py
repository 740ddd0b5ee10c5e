"""The phases of a training step, named once.

A phase has one name per place it appears, and they used to be spelled in three modules:

- ``span``: the span's name in the timeline and the spool (``optimizer_step``, as
  spool-format-v1.md's canonical scope shape names it), and the key of a step's phase times;
- ``attr``: the key of its time in a step span's attrs (``optimizer_step_ns``);
- ``share``: its name in the summaries' ``phase_share`` (``optimizer``), which is also the stem of
  its column in the history's ``steps`` table (``column``: ``optimizer_ns``).

Everything else is derived from ``PHASES``. To add a phase (``recompute``, say), add one row:
the capture's phase times, the step attrs, the history's ``steps`` columns, the span-tree
derivation of other producers' steps and the summary's shares all follow. ``wait`` is no phase
of its own: it is the step's residual, ``max(0, step - every phase with in_residual)``
(aggregator-architecture.md), kept beside the phases in attrs, columns and shares.

This module sits below capture, store and analysis (tests/structure/test_layers.py), and
imports nothing.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PHASES", "RESIDUAL", "Phase", "SHARES", "SPAN_NAMES", "STEP_ATTRS", "STEP_COLUMNS", "by_span"]


class Phase(NamedTuple):
    span: str  # timeline / spool span name
    share: str  # summary name; ``<share>_ns`` is its history column
    in_residual: bool = True  # subtracted from the step's time to give ``wait``
    trains: bool = False  # only a training step runs it: a step that did is never evaluation

    @property
    def attr(self) -> str:
        return f"{self.span}_ns"

    @property
    def column(self) -> str:
        return f"{self.share}_ns"


PHASES: tuple[Phase, ...] = (
    # the fetch of the step's batch: before the step's compute, so the residual keeps it
    Phase("data_load", "data_load", in_residual=False),
    Phase("h2d", "h2d"),
    Phase("forward", "forward"),
    Phase("backward", "backward", trains=True),
    Phase("optimizer_step", "optimizer", trains=True),
    # forwards re-run during backward by activation checkpointing (docs/step-inference.md)
    Phase("recompute", "recompute", trains=True),
)
RESIDUAL = Phase("wait", "wait", in_residual=False)

SPAN_NAMES: tuple[str, ...] = tuple(p.span for p in PHASES)
STEP_ATTRS: tuple[str, ...] = (*(p.attr for p in PHASES), RESIDUAL.attr)  # after ``step_ns``
STEP_COLUMNS: tuple[str, ...] = (*(p.column for p in PHASES), RESIDUAL.column)  # after ``step_ns``
SHARES: tuple[str, ...] = (*(p.share for p in PHASES), RESIDUAL.share)


def by_span(name: str) -> Phase | None:
    """The phase whose spans are named ``name``, or None."""
    return _BY_SPAN.get(name)


_BY_SPAN = {p.span: p for p in PHASES}
if len(_BY_SPAN) != len(PHASES) or len(set(SHARES)) != len(SHARES):
    raise ValueError("two phases share a name")  # at import: a table that cannot be read both ways
