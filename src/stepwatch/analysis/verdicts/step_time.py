"""Step-time verdicts: where a step's time goes, which rank holds the others back, and how much
wall time falls between steps. Rules over a ``StepWindow`` (``step_windows``); the
formulas and thresholds are published in docs/verdicts.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from statistics import median as _median
from typing import Any

from .model import SEVERITY_RANK, Severity, Verdict
from .policy import VerdictPolicy
from .step_windows import COMPONENTS, COMPUTE_PHASES, RankWindow, StepWindow

__all__ = ["PRIMARY_ORDER", "pick_primary", "step_time_verdicts"]

# among findings of the same severity, the one a user should act on first
PRIMARY_ORDER: tuple[str, ...] = (
    "STRAGGLER", "INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "INPUT_BOUND", "H2D_BOUND",
    "RESIDUAL_HEAVY", "BETWEEN_STEPS", "COMPUTE_BOUND", "INCOMPLETE_DATA", "WARMUP", "BALANCED",
    "INSUFFICIENT_STEP_TIME_DATA",
)
_LABELS = {"input": "input (the batch fetch)", "h2d": "host-to-device copies", "residual":
           "time inside steps outside every measured phase (the residual)"}
_NEXT = {
    "INPUT_BOUND": "more DataLoader workers (num_workers), pin_memory=True, a larger prefetch_factor, or faster storage",
    "H2D_BOUND": "pin_memory=True with .to(device, non_blocking=True), fewer and larger copies, or keep data on the device",
    "RESIDUAL_HEAVY": "find the host work inside the step between its phases: the loss computation and "
                      "zero_grad (a loss module's call is no forward time), .item() syncs, logging, metrics, "
                      "CPU preprocessing; stepwatch.scope() names it",
    "BETWEEN_STEPS": "move logging, checkpointing, evaluation and sleeps off the step path, or do them less often",
    "COMPUTE_BOUND": "make the model itself faster: mixed precision, torch.compile, fused optimizers, a larger batch",
}


def _ms(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def _r4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)



def _severity(value: float, warn: float, crit: float, window: StepWindow, policy: VerdictPolicy) -> Severity | None:
    if value < warn:
        return None
    if value >= crit and window.steps >= policy.confident_steps:
        return "crit"
    return "warn"


def _ranks_list(ranks: Any) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


class _Shares:
    """Each component's share per rank (known ranks only) and its median over them."""

    def __init__(self, window: StepWindow, policy: VerdictPolicy) -> None:
        coverage = policy.min_phase_coverage
        self.per_rank: dict[str, dict[int, float]] = {}
        for name in COMPONENTS:
            shares = {rank: s for rank, w in window.ranks.items() if (s := w.share(name, coverage)) is not None}
            self.per_rank[name] = shares
        between = {rank: s for rank, w in window.ranks.items() if (s := w.between_share) is not None}
        self.per_rank["between_steps"] = between
        self.median = {name: _median(list(v.values())) if v else None for name, v in self.per_rank.items()}

    def evidence(self) -> dict[str, Any]:
        return {name: _r4(value) for name, value in self.median.items()}


def step_time_verdicts(window: StepWindow, policy: VerdictPolicy,
                       barrier_wait_ns: Mapping[int, float] | None = None) -> list[Verdict]:
    """Every step-time finding on ``window``, most severe first (the primary is the first);
    ``barrier_wait_ns``: each rank's wait in ``dist.barrier()`` between those steps."""
    base = {"window": window.evidence()}
    if not window.ranks:
        return []
    if window.steps < policy.warmup_steps:
        return [Verdict("WARMUP", "info", None, (),
                        f"only {window.steps} step(s) completed on every rank; verdicts start at {policy.warmup_steps}",
                        "wait for more steps", base)]
    shares = _Shares(window, policy)
    found: list[Verdict] = []
    incomplete = _incomplete(window, policy, base)
    if incomplete is not None:
        found.append(incomplete)
    found.extend(_straggler(window, policy, shares, base))
    for name, component, warn, crit in (
        ("INPUT_BOUND", "input", policy.input_share_warn, policy.input_share_crit),
        ("H2D_BOUND", "h2d", policy.h2d_share_warn, policy.h2d_share_crit),
        ("RESIDUAL_HEAVY", "residual", policy.residual_share_warn, policy.residual_share_crit),
    ):
        verdict = _share_verdict(name, component, warn, crit, window, policy, shares, base)
        if verdict is not None:
            found.append(verdict)
    between = _between_steps(window, policy, shares, base, barrier_wait_ns or {})
    if between is not None:
        found.append(between)
    compute = _compute_bound(window, policy, shares, base)
    if compute is not None:
        found.append(compute)
    found = [v for v in found if policy.enabled(v.name)]
    judged = shares.median["input"] is not None or shares.median["compute"] is not None
    quiet = not any(SEVERITY_RANK[v.severity] > 0 or v.name == "COMPUTE_BOUND" for v in found)
    if judged and quiet and policy.enabled("BALANCED"):
        found.append(_balanced(window, shares, base))
    return sorted(found, key=_rank_key)


def _rank_key(verdict: Verdict) -> tuple[Any, ...]:
    order = PRIMARY_ORDER.index(verdict.name) if verdict.name in PRIMARY_ORDER else len(PRIMARY_ORDER)
    return (-SEVERITY_RANK[verdict.severity], order, -(verdict.score or 0.0), verdict.ranks)


def pick_primary(step_time: list[Verdict], window: StepWindow) -> Verdict:
    """The most severe step-time finding; with none of warn or crit, COMPUTE_BOUND, WARMUP,
    BALANCED or INCOMPLETE_DATA as found; with no steps, INSUFFICIENT_STEP_TIME_DATA."""
    if step_time:
        return step_time[0]
    return Verdict("INSUFFICIENT_STEP_TIME_DATA", "info", None, (),
                   "no step was completed on every rank: nothing can be said about step time"
                   if window.ranks or window.ranks_without_steps else "no step data to judge",
                   "train for a few steps with stepwatch capturing (stepwatch run, stepwatch.init or trace_step)",
                   {"window": window.evidence(), "rows_ignored": window.rows_ignored,
                    "ranks_without_steps": list(window.ranks_without_steps)})


def _share_verdict(name: str, component: str, warn: float, crit: float, window: StepWindow, policy: VerdictPolicy,
                   shares: _Shares, base: dict[str, Any]) -> Verdict | None:
    value = shares.median[component]
    if value is None:
        return None
    severity = _severity(value, warn, crit, window, policy)
    if severity is None:
        return None
    per_rank = shares.per_rank[component]
    culprits = tuple(sorted(r for r, s in per_rank.items() if s >= warn))
    coverage = policy.min_phase_coverage
    mean = _median([m for w in window.ranks.values() if (m := w.mean_ns(component, coverage)) is not None])
    over = f"median over {len(per_rank)} ranks" if len(per_rank) > 1 else f"rank {next(iter(per_rank))}"
    message = (f"{_LABELS[component]} takes {value * 100:.1f}% of step time ({_ms(mean)} ms a step, {over}); "
               f"{severity} at {(crit if severity == 'crit' else warn) * 100:.0f}%")
    return Verdict(name, severity, _r4(value), culprits, message, _NEXT[name],
                   {**base, "share": _r4(value), "share_per_rank": {str(r): _r4(s) for r, s in sorted(per_rank.items())},
                    "mean_ms": _ms(mean), "mean_step_ms": _ms(_median([w.mean_step_ns for w in window.ranks.values()])),
                    "thresholds": {"warn": warn, "crit": crit}, "shares": shares.evidence()})


def _between_steps(window: StepWindow, policy: VerdictPolicy, shares: _Shares, base: dict[str, Any],
                   barrier_wait_ns: Mapping[int, float]) -> Verdict | None:
    value = shares.median["between_steps"]
    if value is None:
        return None
    warn, crit = policy.between_steps_share_warn, policy.between_steps_share_crit
    severity = _severity(value, warn, crit, window, policy)
    if severity is None:
        return None
    per_rank = shares.per_rank["between_steps"]
    culprits = tuple(sorted(r for r, s in per_rank.items() if s >= warn))
    gap = _median([w.between_ns / max(1, w.steps - 1) for w in window.ranks.values() if w.between_ns is not None])
    step = _median([w.mean_step_ns for w in window.ranks.values()])
    message = (f"{value * 100:.1f}% of wall time falls between steps ({_ms(gap)} ms after each {_ms(step)} ms step): "
               f"time the step statistics do not show")
    advice = _NEXT["BETWEEN_STEPS"]
    evidence: dict[str, Any] = {}
    # Ranks kept in step by a barrier share one gap, whichever of them works in it: a rank that
    # spent at least half of it waiting in dist.barrier() waited for the others.
    waited = {r: min(window.ranks[r].between_ns or 0.0, barrier_wait_ns.get(r, 0.0)) for r in culprits}
    waiters = tuple(r for r in culprits if waited[r] > (window.ranks[r].between_ns or 0.0) / 2)
    workers = tuple(r for r in culprits if r not in waiters)
    if workers and waiters:
        per_step = {r: waited[r] / max(1, window.ranks[r].steps - 1) for r in culprits}
        message += (f"; {_ranks_list(workers)} {'works' if len(workers) == 1 else 'work'} in it while "
                    f"{_ranks_list(waiters)} {'waits' if len(waiters) == 1 else 'wait'} "
                    f"{_ms(_median([per_step[r] for r in waiters]))} ms a step in dist.barrier() for "
                    f"{'it' if len(workers) == 1 else 'them'}")
        advice = f"on {_ranks_list(workers)}: {advice}"
        culprits = workers
        evidence = {"barrier_wait_ms_per_step": {str(r): _ms(ns) for r, ns in per_step.items()}}
    elif len(per_rank) > 1 and len(culprits) == len(per_rank):
        advice += ("; every rank shows it: where one rank alone does that work (a checkpoint or evaluation "
                   "on rank 0), the others wait for it at the next barrier or collective, and "
                   "stepwatch.scope() on that rank names it")
    return Verdict("BETWEEN_STEPS", severity, _r4(value), culprits, message, advice,
                   {**base, "share_of_wall": _r4(value),
                    "share_per_rank": {str(r): _r4(s) for r, s in sorted(per_rank.items())},
                    "between_ms_per_step": _ms(gap), "mean_step_ms": _ms(step), **evidence,
                    "thresholds": {"warn": warn, "crit": crit}})


def _compute_bound(window: StepWindow, policy: VerdictPolicy, shares: _Shares, base: dict[str, Any]) -> Verdict | None:
    value = shares.median["compute"]
    if value is None or value < policy.compute_bound_share:
        return None
    for component, warn in (("input", policy.input_share_warn), ("h2d", policy.h2d_share_warn),
                            ("residual", policy.residual_share_warn)):
        other = shares.median[component]
        if other is None or other >= warn:
            return None  # another share unknown: dominance cannot be established
    phases = {p: shares.median[p] for p in COMPUTE_PHASES
              if shares.median[p] is not None}
    largest = max(sorted(phases), key=lambda p: phases[p] or 0.0) if phases else "compute"
    message = f"compute-bound: forward, backward and optimizer take {value * 100:.1f}% of step time; {largest} is the largest"
    return Verdict("COMPUTE_BOUND", "info", _r4(value), (), message, _NEXT["COMPUTE_BOUND"],
                   {**base, "share": _r4(value), "largest_phase": largest, "shares": shares.evidence(),
                    "threshold": policy.compute_bound_share})


def _balanced(window: StepWindow, shares: _Shares, base: dict[str, Any]) -> Verdict:
    parts = [f"{name} {shares.median[name] * 100:.0f}%"  # type: ignore[operator]
             for name in ("compute", "input", "h2d", "residual") if shares.median[name] is not None]
    return Verdict("BALANCED", "info", None, (),
                   f"no bottleneck over {window.steps} steps on {len(window.ranks)} rank(s): " + ", ".join(parts),
                   None, {**base, "shares": shares.evidence()})


_NEEDED = {"input": "data_load_ns", "h2d": "h2d_ns", "compute": "forward_ns, backward_ns, optimizer_ns",
           "residual": "wait_ns and data_load_ns", "backward": "backward_ns"}


def _incomplete(window: StepWindow, policy: VerdictPolicy, base: dict[str, Any]) -> Verdict | None:
    """A signal some ranks measured and others did not (or no rank did on enough steps): the
    verdicts that need it abstain rather than read the gap as 0."""
    coverage = policy.min_phase_coverage
    missing: dict[str, list[int]] = {}
    for component in _NEEDED:
        have = [rank for rank, w in window.ranks.items() if w.has(component, coverage)]
        lacking = sorted(set(window.ranks) - set(have))
        if lacking:
            missing[component] = lacking
    if not missing and not window.ranks_without_steps:
        return None
    ranks = sorted({r for rs in missing.values() for r in rs} | set(window.ranks_without_steps))
    parts = [f"{component} ({_NEEDED[component]}) on {_ranks_list(rs)}" for component, rs in missing.items()]
    if window.ranks_without_steps:
        parts.append(f"every step on {_ranks_list(window.ranks_without_steps)}")
    return Verdict("INCOMPLETE_DATA", "info", None, tuple(ranks),
                   "not measured, so not judged: " + "; ".join(parts),
                   "check those ranks' capture (stepwatch summary: collector health, drops)",
                   {**base, "missing": dict(missing),
                    "known_steps": {c: {str(r): w.known.get(c, 0) for r, w in sorted(window.ranks.items())}
                                    for c in missing},
                    "ranks_without_steps": list(window.ranks_without_steps), "min_phase_coverage": coverage})


_CAUSES = (("input", "INPUT_STRAGGLER", "its input (batch fetch)"), ("h2d", "H2D_STRAGGLER", "its host-to-device copies"),
           ("forward", "COMPUTE_STRAGGLER", "its forward compute"))
_CAUSE_NEXT = {
    "INPUT_STRAGGLER": "its input pipeline is slower: more DataLoader workers there, or check its storage and CPU share",
    "H2D_STRAGGLER": "its copies to the device are slower: pin_memory, non_blocking copies, the PCIe/NUMA placement",
    "COMPUTE_STRAGGLER": "its compute is slower: check that device (clocks, heat, other processes) and uneven batch shapes",
    "STRAGGLER": "it is slow outside the measured phases: look for work only it does (logging, checkpointing on rank 0)",
}


def _straggler(window: StepWindow, policy: VerdictPolicy, shares: _Shares, base: dict[str, Any]) -> list[Verdict]:
    """Under data parallelism every rank waits in backward's all-reduce for the slowest one, so
    the straggler is the rank that waits *least* there: the lowest mean backward time. Its score
    is (reference backward - its backward) / reference step time, the reference being the median
    rank by backward; the cause is the phase where it spends more than the reference, when that
    excess covers ``straggler_cause_coverage_min`` of the cost."""
    coverage = policy.min_phase_coverage
    eligible: dict[int, RankWindow] = {
        rank: w for rank, w in window.ranks.items()
        if (w.mean_ns("backward", coverage) or 0.0) > 0 and w.mean_step_ns > 0
    }
    if len(eligible) < 2:
        return []
    backward = {rank: w.mean_ns("backward", coverage) or 0.0 for rank, w in eligible.items()}
    ordered = sorted(backward, key=lambda r: (backward[r], r))
    reference = ordered[len(ordered) // 2]
    ref_window = eligible[reference]
    ref_step = ref_window.mean_step_ns
    scores = {rank: (backward[reference] - backward[rank]) / ref_step for rank in ordered}
    culprits = tuple(sorted(r for r in ordered if scores[r] >= policy.straggler_score_warn))
    if not culprits:
        return []
    worst = ordered[0]
    score = scores[worst]
    cost = backward[reference] - backward[worst]
    worst_window = eligible[worst]
    excess: dict[str, float] = {}
    for component, _, _ in _CAUSES:
        mine, theirs = worst_window.mean_ns(component, coverage), ref_window.mean_ns(component, coverage)
        if mine is not None and theirs is not None:
            excess[component] = max(0.0, mine - theirs)
    coverage_by_cause = {c: min(1.0, e / cost) for c, e in excess.items()} if cost > 0 else {}
    name, cause_label, cause = "STRAGGLER", "something outside the measured phases", None
    if coverage_by_cause:
        best = max(coverage_by_cause, key=lambda c: (coverage_by_cause[c], -[k for k, _, _ in _CAUSES].index(c)))
        if coverage_by_cause[best] > 0 and coverage_by_cause[best] >= policy.straggler_cause_coverage_min:
            cause = best
            name, cause_label = next((n, label) for c, n, label in _CAUSES if c == best)
    severity: Severity = "crit" if score >= policy.straggler_score_crit and window.steps >= policy.confident_steps else "warn"
    held = sorted(set(eligible) - set(culprits))
    who = _ranks_list(culprits)
    holds, it = ("holds", "it") if len(culprits) == 1 else ("hold", "them")
    waits = "waits" if len(held) == 1 else "wait"
    message = (f"{who} {holds} the others back: {_ranks_list(held)} {waits} {_ms(cost)} ms a step for {it} in backward's "
               f"all-reduce ({score * 100:.0f}% of a {_ms(ref_step)} ms step); cause: {cause_label}")
    return [Verdict(name, severity, _r4(score), culprits, message, f"on {who}: {_CAUSE_NEXT[name]}",
                    {**base, "score": _r4(score), "culprit": worst, "reference_rank": reference,
                     "held_back": held, "wait_ms": _ms(cost), "reference_step_ms": _ms(ref_step),
                     "backward_ms": {str(r): _ms(backward[r]) for r in sorted(backward)},
                     "score_per_rank": {str(r): _r4(max(0.0, scores[r])) for r in sorted(scores)},
                     "cause": cause, "cause_excess_ms": {c: _ms(e) for c, e in excess.items()},
                     "cause_coverage": {c: _r4(v) for c, v in coverage_by_cause.items()},
                     "thresholds": {"warn": policy.straggler_score_warn, "crit": policy.straggler_score_crit,
                                    "cause_coverage_min": policy.straggler_cause_coverage_min}})]
