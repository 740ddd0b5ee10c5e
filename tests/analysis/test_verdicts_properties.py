"""Properties of the verdict engine over any rows (hypothesis): it never crashes, its shares stay
in [0, 1], it is deterministic, and a missing phase is never read as 0."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stepwatch.analysis.verdicts import diagnose
from stepwatch.analysis.verdicts.step_windows import build_window
from stepwatch.phases import STEP_COLUMNS

from .verdict_rows import steps

COLUMNS = ("start_ns", "end_ns", "step_ns", *STEP_COLUMNS)
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(-(1 << 70), 1 << 70), st.lists(st.integers(), max_size=2))
plausible = st.one_of(st.none(), st.integers(0, 50_000_000), st.floats(0, 5e7))
value = st.one_of(plausible, plausible, junk)
row = st.fixed_dictionaries(
    {"rank": st.one_of(st.integers(0, 4), junk), "step": st.one_of(st.integers(-2, 40), junk)},
    optional=dict.fromkeys(COLUMNS, value),
)
any_rows = st.lists(st.one_of(row, st.integers(), st.none()), max_size=60)
sample = st.fixed_dictionaries({
    "rank": st.integers(0, 4), "timestamp_ns": st.one_of(st.integers(0, 2_000_000_000), junk),
    "collector": st.sampled_from(["stepwatch.cpu_tracker", "stepwatch.cuda_tracker", "stepwatch.nvml_tracker", 3]),
    "device_id": st.one_of(st.integers(-1, 2), junk), "allocated": value, "reserved": value, "free": value,
    "total": value, "host": st.one_of(st.just("h"), junk), "event_type": st.sampled_from(["sample", "start"]),
})
system = st.fixed_dictionaries({"rank": st.integers(0, 3), "timestamp_ns": value, "device_id": value,
                                "gpu_util_pct": value})


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_rows, st.lists(sample, max_size=30), st.lists(system, max_size=10), st.one_of(st.none(), st.integers(1, 50)))
@example(rows=[{"rank": 0, "step": 0}, {"rank": 0, "step": None},  # a clock past int64: unknown
               {"rank": 0, "step": 0, "start_ns": 9.223372036854776e18, "step_ns": 0}], memory=[], sys=[], window=None)
def test_any_rows_give_a_diagnosis_with_shares_in_range_and_the_same_twice(rows: list, memory: list, sys: list,
                                                                        window: int | None) -> None:
    first = diagnose(rows, memory, sys, window=window)
    again = diagnose(rows, memory, sys, window=window, columnar=True)
    assert first.to_dict() == diagnose(rows, memory, sys, window=window).to_dict()
    json.dumps(first.to_dict(), allow_nan=False)
    json.dumps(again.to_dict(), allow_nan=False)
    assert first.primary.severity in ("info", "warn", "crit")
    for verdict in first.all():
        assert _finite(verdict.to_dict())
        assert "\n" not in verdict.message
        for key in ("share", "share_of_wall"):
            if key in verdict.evidence:
                assert 0.0 <= verdict.evidence[key] <= 1.0
        for share in verdict.evidence.get("shares", {}).values():
            assert share is None or 0.0 <= share <= 1.0
    clean = [r for r in rows if isinstance(r, dict)]
    built = build_window(clean, window)
    for rank_window in built.ranks.values():
        for component in rank_window.sums:
            share = rank_window.share(component, 0.5)
            assert share is None or 0.0 <= share <= 1.0
        assert rank_window.between_share is None or 0.0 <= rank_window.between_share <= 1.0


phase = st.sampled_from(list(STEP_COLUMNS))


@settings(max_examples=150, deadline=None)
@given(phase, st.integers(1, 3), st.integers(20, 80), st.floats(0.5, 6.0))
def test_a_missing_phase_is_never_read_as_zero(column: str, ranks: int, count: int, fetch: float) -> None:
    """A phase that no step of a rank measured is unknown there: the shares it feeds are not
    given for that rank, INCOMPLETE_DATA names it, and nothing is judged from a 0 put in its place."""
    rows: list[dict[str, Any]] = []
    for rank in range(ranks):
        rows += steps(rank, count, fetch=fetch)
    lacking = ranks - 1
    zeroed = [dict(r) for r in rows]
    for r in rows:
        if r["rank"] == lacking:
            r[column] = None
    for r in zeroed:
        if r["rank"] == lacking:
            r[column] = 0
    window = build_window(rows, None)
    affected = {"data_load_ns": ("input", "residual"), "wait_ns": ("residual",), "h2d_ns": ("h2d",),
                "recompute_ns": ("compute", "recompute")}.get(column, ("compute", column.removesuffix("_ns")))
    for component in affected:
        assert window.ranks[lacking].share(component, 0.5) is None
        if ranks > 1:
            assert window.ranks[0].share(component, 0.5) is not None
    diagnosis = diagnose(rows)
    incomplete = [v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA"]
    assert incomplete and lacking in incomplete[0].ranks
    for verdict in diagnosis.step_time:
        if verdict.name in ("INPUT_BOUND", "H2D_BOUND", "RESIDUAL_HEAVY", "COMPUTE_BOUND"):
            assert str(lacking) not in verdict.evidence.get("share_per_rank", {}) or \
                verdict.evidence["share_per_rank"][str(lacking)] is not None
        assert lacking not in verdict.ranks or verdict.name == "INCOMPLETE_DATA" or "STRAGGLER" not in verdict.name
    assert not any("STRAGGLER" in v.name for v in diagnosis.step_time)


@settings(max_examples=100, deadline=None)
@given(st.permutations(list(range(40))))
def test_row_order_does_not_matter(order: list[int]) -> None:
    rows = steps(0, 20, fetch=2.0) + steps(1, 20, forward=5.0)
    assert diagnose([rows[i] for i in order]).to_dict() == diagnose(rows).to_dict()


number = st.one_of(st.none(), st.integers(0, 10_000_000), st.floats(0, 1e7))
clock = st.one_of(st.none(), st.integers(0, 1_000_000_000))
plausible_row = st.fixed_dictionaries(
    {"rank": st.integers(0, 3), "step": st.integers(0, 30), "step_ns": st.integers(0, 20_000_000)},
    optional={"start_ns": clock, "end_ns": clock, **dict.fromkeys(STEP_COLUMNS, number)},
)


@settings(max_examples=300, deadline=None)
@given(st.lists(plausible_row, max_size=80), st.one_of(st.none(), st.integers(1, 20)))
def test_the_numpy_reduction_gives_what_the_row_reduction_gives(rows: list, window: int | None) -> None:
    by_rows = build_window(rows, window, columnar=False)
    by_columns = build_window(rows, window, columnar=True)
    assert (by_rows.first_step, by_rows.last_step, by_rows.rows_ignored, by_rows.ranks_without_steps) == \
        (by_columns.first_step, by_columns.last_step, by_columns.rows_ignored, by_columns.ranks_without_steps)
    assert sorted(by_rows.ranks) == sorted(by_columns.ranks)
    for rank, a in by_rows.ranks.items():
        b = by_columns.ranks[rank]
        assert (a.steps, a.first_step, a.last_step, a.start_ns, a.end_ns) == \
            (b.steps, b.first_step, b.last_step, b.start_ns, b.end_ns)
        assert a.known == b.known
        for name in a.sums:
            assert math.isclose(a.sums[name], b.sums[name], rel_tol=1e-9, abs_tol=1e-3)
            assert math.isclose(a.denominators[name], b.denominators[name], rel_tol=1e-9, abs_tol=1e-3)
        assert math.isclose(a.step_total_ns, b.step_total_ns, rel_tol=1e-9, abs_tol=1e-3)
        assert (a.between_ns is None) == (b.between_ns is None)
        if a.between_ns is not None:
            assert math.isclose(a.between_ns, b.between_ns, rel_tol=1e-9, abs_tol=1e-3)
            assert math.isclose(a.between_wall_ns, b.between_wall_ns, rel_tol=1e-9, abs_tol=1e-3)
        assert a.step_clock() == b.step_clock()
    assert diagnose(rows, window=window, columnar=False).to_dict() == \
        diagnose(rows, window=window, columnar=True).to_dict()


mem_number = st.one_of(st.none(), st.integers(0, 80 << 30))
mem_sample = st.fixed_dictionaries({
    "rank": st.integers(0, 3), "timestamp_ns": st.integers(0, 1_200_000_000),
    "collector": st.sampled_from(["stepwatch.cpu_tracker", "stepwatch.cuda_tracker", "stepwatch.nvml_tracker"]),
    "device_id": st.integers(-1, 2), "allocated": mem_number, "reserved": mem_number, "free": mem_number,
    "total": st.one_of(st.none(), st.integers(0, 80 << 30)), "host": st.sampled_from(["a", "b"]),
}, optional={"event_type": st.sampled_from(["sample", "stop"])})


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 120), st.lists(mem_sample, max_size=120), st.booleans())
def test_the_numpy_memory_facts_are_the_row_facts(ranks: int, count: int, samples: list, columns: bool) -> None:
    from stepwatch.analysis.verdicts.memory import _facts_from_samples, parse_samples
    from stepwatch.analysis.verdicts.memory_arrays import facts_from_arrays

    rows: list[dict[str, Any]] = []
    for rank in range(ranks):
        rows += [{**r, "start_ns": r["start_ns"] // 10, "end_ns": r["end_ns"] // 10}
                 for r in steps(rank, count, t0=0)]
    window = build_window(rows, None, columnar=columns)
    by_rows = _facts_from_samples(parse_samples(samples, window), window)
    by_arrays = facts_from_arrays(samples, window)
    assert by_arrays is not None
    for name in ("kind", "samples", "peaks", "totals", "hosts", "counts", "worst", "median", "host_used",
                 "host_ranks", "rss"):
        assert getattr(by_rows, name) == getattr(by_arrays, name), name
    for rank in by_rows.own.ranks():
        assert by_rows.own[rank] == by_arrays.own[rank]
    by_arrays_diagnosis = diagnose(rows, samples, columnar=True).to_dict()
    assert diagnose(rows, samples, columnar=False).to_dict() == by_arrays_diagnosis
    json.dumps(by_arrays_diagnosis, allow_nan=False)  # plain JSON: no numpy scalar, no NaN


@pytest.mark.parametrize("columns", [False, True])
def test_a_sample_taken_as_a_step_starts_belongs_to_that_step(columns: bool) -> None:
    from stepwatch.analysis.verdicts.memory import _facts_from_samples, parse_samples
    from stepwatch.analysis.verdicts.memory_arrays import facts_from_arrays

    rows = [r for rank in range(2) for r in steps(rank, 30, t0=0)]
    samples = [{"rank": r["rank"], "timestamp_ns": r["start_ns"], "collector": "stepwatch.cpu_tracker",
                "device_id": -1, "allocated": (1 << 30) + r["step"] * (1 << 20), "reserved": 0, "free": 1 << 33,
                "total": 1 << 34, "host": "a"} for r in rows]
    window = build_window(rows, None, columnar=columns)
    by_rows = _facts_from_samples(parse_samples(samples, window), window)
    by_arrays = facts_from_arrays(samples, window)
    assert by_arrays is not None and by_arrays.worst == by_rows.worst
    # each sample is its own step's: the series grows by a step's 1 MiB from the first step on
    assert len(by_rows.worst) == 30 and by_rows.worst[1] - by_rows.worst[0] == 1 << 20


@pytest.mark.parametrize("clock", [2**63, 2.0**63, 2**64])
def test_a_clock_past_int64_is_unknown_on_rows_with_many_samples(clock: Any) -> None:
    # few step rows (reduced row by row) with enough samples for the memory facts on arrays
    rows = [r for rank in range(2) for r in steps(rank, 10, t0=0)]
    rows[3] = {**rows[3], "start_ns": clock}
    rows[4] = {**rows[4], "end_ns": clock}
    samples = [{"rank": rank, "timestamp_ns": 1_000 + i, "collector": "stepwatch.cpu_tracker", "device_id": -1,
                "allocated": 1 << 30, "reserved": 0, "free": 1 << 33, "total": 1 << 34, "host": "a"}
               for rank in range(2) for i in range(150)]
    assert diagnose(rows, samples).to_dict() == diagnose(rows, samples, columnar=False).to_dict()
