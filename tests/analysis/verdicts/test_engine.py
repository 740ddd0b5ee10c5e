"""The step-time verdicts, each with rows that provoke it and rows that must not, and the three
places TraceML 0.5.0 is known to be wrong (docs/verdicts.md)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stepwatch.analysis.verdicts import DEFAULT_POLICY, Diagnosis, VerdictPolicy, diagnose
from tests.support.verdict_rows import MS, steps


def loud(diagnosis: Diagnosis) -> list[tuple[str, str, tuple[int, ...]]]:
    """The warn and crit findings: a clean run has none."""
    return [(v.name, v.severity, v.ranks) for v in diagnosis.all() if v.severity != "info"]


def names(diagnosis: Diagnosis) -> list[str]:
    return [v.name for v in diagnosis.step_time]


def world(count: int, ranks: int = 2, **per_rank: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rank in range(ranks):
        out += steps(rank, count, **per_rank.get(f"r{rank}", {}))
    return out


# -- a clean run says nothing loud -------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_balanced_run_gives_no_warn_or_crit(ranks: int) -> None:
    diagnosis = diagnose(world(200, ranks))
    assert loud(diagnosis) == []
    assert diagnosis.primary.severity == "info"
    assert diagnosis.primary.name in ("COMPUTE_BOUND", "BALANCED")
    evidence = diagnosis.primary.evidence
    assert evidence["window"]["steps"] == 200 and evidence["window"]["ranks"] == list(range(ranks))


def test_compute_bound_is_information_naming_the_largest_phase() -> None:
    diagnosis = diagnose(world(100, 1))
    assert diagnosis.primary.name == "COMPUTE_BOUND"
    assert diagnosis.primary.evidence["largest_phase"] == "backward"
    assert diagnosis.primary.score == pytest.approx(8 / 8.5, abs=1e-3)


def test_no_compute_bound_without_dominance() -> None:
    diagnosis = diagnose(world(100, 1, r0={"fetch": 0.5, "other": 0.5}))  # compute 89 %
    assert "COMPUTE_BOUND" not in names(diagnosis)
    assert diagnosis.primary.name == "BALANCED"


# -- input -------------------------------------------------------------------------------------


def test_input_bound_warn_and_crit() -> None:
    warn = diagnose(world(100, 2, r0={"fetch": 1.2}, r1={"fetch": 1.2}))
    assert warn.primary.name == "INPUT_BOUND" and warn.primary.severity == "warn"
    assert warn.primary.ranks == (0, 1)
    assert warn.primary.score == pytest.approx(1.2 / 9.5, abs=1e-3)
    crit = diagnose(world(100, 1, r0={"fetch": 3.0}))
    assert crit.primary.name == "INPUT_BOUND" and crit.primary.severity == "crit"
    assert "DataLoader" in (crit.primary.next_step or "")
    assert crit.primary.evidence["mean_ms"] == pytest.approx(3.0)


def test_a_fetch_under_the_warn_share_is_no_input_verdict() -> None:
    assert "INPUT_BOUND" not in names(diagnose(world(100, 1, r0={"fetch": 0.6})))


def test_a_fetch_inside_the_step_is_counted_once() -> None:
    """TraceML defect 1: the residual of a user-marked step holds its fetch; counted as input and
    again as residual it made every input-bound run residual-heavy too."""
    diagnosis = diagnose(world(100, 1, r0={"fetch": 3.0}))
    assert "RESIDUAL_HEAVY" not in names(diagnosis)
    shares = diagnosis.primary.evidence["shares"]
    assert shares["residual"] == pytest.approx(0.3 / 11.3, abs=1e-3)
    total = shares["input"] + shares["h2d"] + shares["compute"] + shares["residual"]
    assert total == pytest.approx(1.0, abs=1e-3)


def test_a_fetch_before_the_step_opens_is_input_and_not_time_between_steps() -> None:
    diagnosis = diagnose(world(100, 1, r0={"fetch": 3.0, "fetch_before": True}))
    assert diagnosis.primary.name == "INPUT_BOUND"
    assert "BETWEEN_STEPS" not in names(diagnosis)


# -- h2d, residual, between steps --------------------------------------------------------------


def test_h2d_bound() -> None:
    diagnosis = diagnose(world(100, 1, r0={"h2d": 2.0}))
    assert diagnosis.primary.name == "H2D_BOUND" and diagnosis.primary.severity == "warn"
    assert "pin_memory" in (diagnosis.primary.next_step or "")
    assert "H2D_BOUND" not in names(diagnosis_of(h2d=0.5))


def diagnosis_of(**kw: Any) -> Diagnosis:
    return diagnose(world(100, 1, r0=kw))


def test_residual_heavy_and_its_old_name() -> None:
    diagnosis = diagnosis_of(other=2.5)
    assert diagnosis.primary.name == "RESIDUAL_HEAVY" and diagnosis.primary.severity == "crit"
    quiet = VerdictPolicy().with_overrides(["disabled=WAIT_HEAVY"])
    assert quiet.disabled == ("RESIDUAL_HEAVY",)
    assert "RESIDUAL_HEAVY" not in names(diagnose(world(100, 1, r0={"other": 2.5}), policy=quiet))
    assert "RESIDUAL_HEAVY" not in names(diagnosis_of(other=0.5))


def test_between_steps_sees_the_sleep_after_each_step() -> None:
    """The issue's example: 7 ms steps, 10 ms of sleep after each."""
    rows = steps(0, 100, fetch=0.0, forward=3.0, backward=3.0, optimizer=1.0, other=0.0, gap=10.0)
    diagnosis = diagnose(rows)
    assert diagnosis.primary.name == "BETWEEN_STEPS" and diagnosis.primary.severity == "crit"
    assert diagnosis.primary.score == pytest.approx(10 / 17, abs=1e-3)
    assert diagnosis.primary.evidence["between_ms_per_step"] == pytest.approx(10.0, abs=0.01)
    assert diagnosis.primary.evidence["mean_step_ms"] == pytest.approx(7.0, abs=0.01)


def test_between_steps_on_every_rank_says_the_others_may_wait_for_one() -> None:
    # rank 0 checkpoints between steps and rank 1 waits for it at a barrier: both see the gap
    both = diagnose(world(100, 2, r0={"gap": 10.0}, r1={"gap": 10.0})).primary
    assert both.name == "BETWEEN_STEPS" and both.ranks == (0, 1)
    assert "the others wait for it at the next barrier" in both.next_step
    one = diagnose(world(100, 2, r0={"gap": 10.0}))  # no barrier: rank 1 goes on and waits in its next step
    between = [v for v in one.step_time if v.name == "BETWEEN_STEPS"]
    assert between and between[0].ranks == (0,) and "the others wait" not in between[0].next_step
    single = diagnose(steps(0, 100, gap=10.0)).primary
    assert single.name == "BETWEEN_STEPS" and "the others wait" not in single.next_step


def test_the_time_waited_in_a_barrier_tells_the_working_rank_from_the_waiting_one() -> None:
    rows = world(100, 2, r0={"gap": 10.0}, r1={"gap": 10.0})
    waited = {1: 99 * 9.5e6}  # rank 1 spent 9.5 of each 10 ms gap in dist.barrier()
    verdict = diagnose(rows, barrier_wait_ns=waited).primary
    assert verdict.name == "BETWEEN_STEPS" and verdict.ranks == (0,)
    assert "rank 0 works in it while rank 1 waits 9.5 ms a step in dist.barrier() for it" in verdict.message
    assert verdict.next_step.startswith("on rank 0: ") and "every rank shows it" not in verdict.next_step
    assert verdict.evidence["barrier_wait_ms_per_step"] == {"0": 0.0, "1": 9.5}
    # both waited (a barrier after work on every rank): no rank is told from another
    both = diagnose(rows, barrier_wait_ns={0: 99 * 9.5e6, 1: 99 * 9.5e6}).primary
    assert both.ranks == (0, 1) and "works in it" not in both.message


def test_contiguous_steps_have_no_time_between_them() -> None:
    assert "BETWEEN_STEPS" not in names(diagnose(steps(0, 100, gap=0.0)))
    assert "BETWEEN_STEPS" not in names(diagnose(steps(0, 100, gap=0.5)))  # 5.6 %


def test_a_missing_step_is_no_time_between_steps() -> None:
    rows = [r for r in steps(0, 100, gap=0.0) if r["step"] % 10 != 5]  # rows lost, not time idle
    assert "BETWEEN_STEPS" not in names(diagnose(rows))


# -- stragglers ----------------------------------------------------------------------------------


def ddp(ranks: int, slow: dict[int, dict[str, float]], count: int = 100) -> list[dict[str, Any]]:
    """Ranks under DDP: every rank's backward ends with the all-reduce, which waits for the
    slowest rank; a rank slower by d ms leaves the others waiting d ms more in backward."""
    extra = {rank: sum(kw.values()) for rank, kw in slow.items()}
    longest = max(extra.values(), default=0.0)
    out: list[dict[str, Any]] = []
    for rank in range(ranks):
        kw = dict(slow.get(rank, {}))
        base = {"fetch": 0.2, "forward": 3.0, "other": 0.3}
        for key, value in kw.items():
            base[key] = base.get(key, 0.0) + value
        out += steps(rank, count, backward=4.0 + longest - extra.get(rank, 0.0), **base)
    return out


@pytest.mark.parametrize(("slow", "name"), [
    ({"forward": 4.0}, "COMPUTE_STRAGGLER"),
    ({"fetch": 4.0}, "INPUT_STRAGGLER"),
    ({"other": 4.0}, "STRAGGLER"),
])
def test_the_straggler_is_the_rank_that_waited_least(slow: dict[str, float], name: str) -> None:
    """TraceML defect 3: under DDP the fast ranks wait in backward's all-reduce; the straggler is
    the rank that waited least, and only it is named (the others go in the evidence)."""
    diagnosis = diagnose(ddp(4, {2: slow}))
    straggler = diagnosis.primary
    assert straggler.name == name
    assert straggler.ranks == (2,)
    assert straggler.severity == "crit"
    assert straggler.evidence["held_back"] == [0, 1, 3]
    assert straggler.evidence["wait_ms"] == pytest.approx(4.0, abs=0.01)
    assert "rank 2 holds the others back" in straggler.message


def test_two_slow_ranks_are_both_named_and_no_other() -> None:
    diagnosis = diagnose(ddp(6, {1: {"forward": 4.0}, 4: {"forward": 4.0}}))
    assert diagnosis.primary.name == "COMPUTE_STRAGGLER"
    assert diagnosis.primary.ranks == (1, 4)


def test_a_small_difference_is_no_straggler() -> None:
    diagnosis = diagnose(ddp(4, {2: {"forward": 0.5}}))  # 0.5 ms of a 9.5 ms step: 5 %
    assert not any("STRAGGLER" in n for n in names(diagnosis))
    assert loud(diagnosis) == []


def test_independent_ranks_of_different_speed_are_no_stragglers() -> None:
    """Without a collective nobody waits: a slower rank's backward is not shorter."""
    rows = steps(0, 100) + steps(1, 100, forward=6.0)
    assert not any("STRAGGLER" in n for n in names(diagnose(rows)))


# -- gates and windows -------------------------------------------------------------------------


def test_no_steps_is_insufficient_data() -> None:
    diagnosis = diagnose([])
    assert diagnosis.primary.name == "INSUFFICIENT_STEP_TIME_DATA"
    assert diagnosis.step_time == () and diagnosis.memory == ()


def test_one_step_is_warmup() -> None:
    diagnosis = diagnose(steps(0, 1, fetch=5.0))
    assert diagnosis.primary.name == "WARMUP" and names(diagnosis) == ["WARMUP"]


def test_under_twenty_steps_nothing_is_crit() -> None:
    few = diagnose(steps(0, 10, fetch=5.0))
    assert few.primary.name == "INPUT_BOUND" and few.primary.severity == "warn"
    many = diagnose(steps(0, 20, fetch=5.0))
    assert many.primary.severity == "crit"


def test_the_live_window_is_the_last_steps_completed_on_every_rank() -> None:
    slow_then_fast = steps(0, 200, fetch=5.0) + steps(0, 100, first=200, t0=10**19)
    rows = slow_then_fast + steps(1, 250, fetch=5.0) + steps(1, 50, first=250, t0=10**19)
    whole = diagnose(rows)
    assert whole.primary.name == "INPUT_BOUND"
    assert whole.primary.evidence["window"]["last_step"] == 299
    live = diagnose(rows, window=40)
    assert live.primary.evidence["window"] == {**live.primary.evidence["window"], "first_step": 260,
                                               "last_step": 299, "steps": 40}
    assert live.primary.name != "INPUT_BOUND"
    lagging = diagnose([r for r in rows if not (r["rank"] == 1 and r["step"] > 220)], window=100)
    assert lagging.primary.evidence["window"]["last_step"] == 220  # rank 1 has not done 221 yet
    assert lagging.primary.evidence["window"]["first_step"] == 121


# -- unknown is never 0 ------------------------------------------------------------------------


def test_a_phase_missing_on_one_rank_is_incomplete_data_never_zero() -> None:
    """Read as 0, rank 1's unmeasured backward would make it the rank that waited least: a
    straggler out of nothing."""
    rows = ddp(4, {})
    for row in rows:
        if row["rank"] == 1:
            row["backward_ns"] = None
    diagnosis = diagnose(rows)
    assert not any("STRAGGLER" in n for n in names(diagnosis))
    incomplete = next(v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA")
    assert incomplete.ranks == (1,)
    assert incomplete.evidence["missing"]["backward"] == [1]
    assert loud(diagnosis) == []


def test_a_rank_without_any_step_is_named() -> None:
    diagnosis = diagnose(steps(0, 100), expected_ranks=[0, 1])
    incomplete = next(v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA")
    assert incomplete.ranks == (1,) and incomplete.evidence["ranks_without_steps"] == [1]


def test_a_fetch_never_measured_leaves_input_unjudged() -> None:
    rows = steps(0, 100, fetch=3.0)
    for row in rows:
        row["data_load_ns"] = None
    diagnosis = diagnose(rows)
    assert "INPUT_BOUND" not in names(diagnosis) and "RESIDUAL_HEAVY" not in names(diagnosis)
    assert "INCOMPLETE_DATA" in names(diagnosis)


def test_one_partial_last_step_does_not_blank_the_window() -> None:
    """TraceML defect 2: one step without its phases (the last, cut short) made every phase of
    the window unavailable."""
    rows = steps(0, 100, fetch=3.0) + steps(1, 100, fetch=3.0)
    whole = diagnose(rows)
    last = next(r for r in rows if r["rank"] == 1 and r["step"] == 99)
    for column in ("data_load_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_ns", "recompute_ns", "wait_ns"):
        last[column] = None
    partial = diagnose(rows)
    assert partial.primary.name == whole.primary.name == "INPUT_BOUND"
    assert partial.primary.score == pytest.approx(whole.primary.score, abs=1e-3)
    assert "INCOMPLETE_DATA" not in names(partial)


# -- determinism -------------------------------------------------------------------------------


def test_same_rows_same_verdicts_in_any_order() -> None:
    rows = ddp(4, {3: {"fetch": 3.0}})
    first = diagnose(rows).to_dict()
    shuffled = list(rows)
    random.Random(7).shuffle(shuffled)
    assert diagnose(shuffled).to_dict() == first == diagnose(rows).to_dict()


def test_every_verdict_has_the_fields_and_one_line() -> None:
    for rows in (ddp(4, {3: {"fetch": 3.0}}), steps(0, 100, gap=10.0), steps(0, 100, other=3.0), steps(0, 1)):
        for verdict in diagnose(rows).all():
            assert verdict.severity in ("info", "warn", "crit")
            assert verdict.message and "\n" not in verdict.message
            assert "window" in verdict.evidence
            assert set(verdict.to_dict()) == {"name", "severity", "score", "ranks", "message", "next_step", "evidence"}


def test_default_policy_is_traceml_defaults() -> None:
    p = DEFAULT_POLICY
    assert (p.input_share_warn, p.input_share_crit, p.compute_bound_share) == (0.10, 0.20, 0.90)
    assert (p.straggler_score_warn, p.straggler_score_crit, p.straggler_cause_coverage_min) == (0.10, 0.20, 0.80)
    assert (p.pressure_warn, p.pressure_crit, p.memory_min_steps, p.warmup_steps, p.confident_steps) == \
        (0.92, 0.97, 50, 2, 20)
    assert p.creep_confirmed_delta_bytes == 1 << 30 and p.live_window_steps == 100
    assert MS == 1_000_000
