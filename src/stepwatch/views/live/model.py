"""The live view's snapshot (``LiveSnapshot``, one ``RankLive`` a rank) and the rule that folds many
ranks down to the few worth a row (``fold_ranks``): pure data, no file is read here, so every
surface draws the same thing from the same snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...phases import PHASES, RESIDUAL

__all__ = ["FOLD_ABOVE", "SHARE_NAMES", "SILENT_AFTER_S", "WINDOW", "LiveSnapshot", "RankLive", "fold_ranks",
           "named_ranks"]

WINDOW = 100  # steps the step time (median), rate and phase shares are measured over
FOLD_ABOVE = 16  # ranks shown one a row up to this many; above, folded (``fold_ranks``)
SILENT_AFTER_S = 15.0  # a rank with no sign of life for this long is shown ``silent`` (``lost`` once its pid is gone)
SHARE_NAMES: tuple[str, ...] = (*(p.share for p in PHASES), RESIDUAL.share)


@dataclass(frozen=True)
class RankLive:
    """One rank now. ``step``: steps it completed; ``step_time_s``: median of its last ``WINDOW``
    steps; ``steps_per_s``: its rate over them; ``phase_shares``: each phase's share of their
    time (``stepwatch.phases`` share names, ``wait`` the rest); ``memory_bytes``/``memory_peak_bytes``:
    its latest and highest memory sample, of ``memory_kind`` ``"device"`` (an accelerator's
    allocation) or ``"rss"`` (the process, when it uses no device); ``heartbeat_age_s``: seconds
    since its last sign of life; ``state``: ``running``, ``stopped`` (a clean end), ``silent``
    (no sign of life for ``SILENT_AFTER_S``) or ``lost`` (silent, and its process is gone: killed)."""

    rank: int
    step: int | None = None
    step_time_s: float | None = None
    steps_per_s: float | None = None
    phase_shares: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    memory_kind: str | None = None
    heartbeat_age_s: float | None = None
    state: str = "running"


@dataclass(frozen=True)
class LiveSnapshot:
    """The whole view at ``taken_at`` (seconds since the epoch). ``verdict``: the current primary
    verdict (``name``, ``severity``, ``ranks``, ``message``, ``next_step``) or None; ``alerts``: the
    latest alerts, oldest first (``kind``, ``severity``, ``ranks``, ``step``, ``message``, ``ts``);
    ``total_steps``: the steps the run will take where known; ``ended``: every rank stopped or
    the launcher recorded the run's end; ``started_at``/``ended_at``: run.json's (seconds)."""

    run_dir: str
    session_id: str | None
    taken_at: float
    ranks: tuple[RankLive, ...] = ()
    world_size: int | None = None
    total_steps: int | None = None
    verdict: dict[str, Any] | None = None
    alerts: tuple[dict[str, Any], ...] = ()
    ended: bool = False
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def elapsed_s(self) -> float | None:
        """How long the run has gone (went, once ended), from run.json's times."""
        if self.started_at is None:
            return None
        return max(0.0, (self.ended_at or self.taken_at) - self.started_at)

    @property
    def step(self) -> int | None:
        """The job's step: the least any rank completed (a collective job goes at its slowest; a
        rank with no step yet has done none). None before any rank's first step."""
        if all(r.step is None for r in self.ranks):
            return None
        return min(r.step or 0 for r in self.ranks)

    @property
    def steps_per_s(self) -> float | None:
        """The job's rate: its slowest running rank's."""
        rates = [r.steps_per_s for r in self.ranks if r.steps_per_s is not None]
        return min(rates) if rates else None

    @property
    def step_time_s(self) -> float | None:
        """The job's step time: its slowest rank's median."""
        times = [r.step_time_s for r in self.ranks if r.step_time_s is not None]
        return max(times) if times else None


def named_ranks(snapshot: LiveSnapshot) -> set[int]:
    """The ranks the primary verdict or an alert names: never folded away. A verdict or alert
    on every rank of a run of several (a run-wide finding) names none in particular."""
    named: set[int] = set()
    everyone = {r.rank for r in snapshot.ranks}
    for source in (snapshot.verdict, *snapshot.alerts):
        ranks = {rank for rank in (source or {}).get("ranks") or () if type(rank) is int}
        if len(everyone) > 1 and ranks >= everyone:
            continue
        named |= ranks
    return named


def fold_ranks(ranks: tuple[RankLive, ...] | list[RankLive], named: set[int] | frozenset[int] = frozenset(),
               limit: int = FOLD_ABOVE) -> list[RankLive]:
    """The ranks to show, by rank. Up to ``limit`` ranks: all of them. Above: the slowest, the
    fastest and the median rank (by step time; ranks with none yet by their step count, fewest
    first, as the slowest), plus every rank in ``named`` (an alert's or the verdict's culprits)."""
    if len(ranks) <= limit:
        return sorted(ranks, key=lambda r: r.rank)
    # slowest first: the longest step time; a rank with no step time yet, behind, counts slowest
    ordered = sorted(ranks, key=lambda r: (r.step_time_s is not None, -(r.step_time_s or 0.0),
                                           r.step if r.step is not None else -1, r.rank))
    keep = {ordered[0].rank, ordered[-1].rank, ordered[len(ordered) // 2].rank} | set(named)
    return sorted((r for r in ranks if r.rank in keep), key=lambda r: r.rank)


def rank_state(age_s: float | None, stopped: bool) -> str:
    """``stopped`` (a clean end), ``silent`` (no sign of life for ``SILENT_AFTER_S``) or ``running``."""
    if stopped:
        return "stopped"
    return "silent" if age_s is not None and age_s > SILENT_AFTER_S else "running"
