"""Properties of the verdict engine over any rows (hypothesis): it never crashes, its shares stay
in [0, 1], it is deterministic, a missing phase is never read as 0, and its one reduction (numpy
arrays) gives what a plain-Python reference of the rules gives (``verdict_oracle``), edge cases
included: clocks past int64, NaN, negatives, bools and strings, empty input, ties."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stepwatch.analysis.verdicts import diagnose
from stepwatch.analysis.verdicts.memory_facts import memory_facts
from stepwatch.analysis.verdicts.step_columns import StepColumns
from stepwatch.analysis.verdicts.step_windows import build_window
from stepwatch.phases import STEP_COLUMNS
from tests.support import examples
from tests.support import verdict_oracle as oracle
from tests.support.verdict_rows import T0, steps

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


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_rows, st.lists(sample, max_size=30), st.lists(system, max_size=10), st.one_of(st.none(), st.integers(1, 50)))
@example(rows=[{"rank": 0, "step": 0}, {"rank": 0, "step": None},  # a clock past int64: unknown
               {"rank": 0, "step": 0, "start_ns": 9.223372036854776e18, "step_ns": 0}], memory=[], sys=[], window=None)
def test_any_rows_give_a_diagnosis_with_shares_in_range_and_the_same_twice(rows: list, memory: list, sys: list,
                                                                        window: int | None) -> None:
    first = diagnose(rows, memory, sys, window=window)
    assert first.to_dict() == diagnose(rows, memory, sys, window=window).to_dict()
    json.dumps(first.to_dict(), allow_nan=False)
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


@settings(max_examples=examples(150), deadline=None)
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
    # recompute is carved out of backward: where it was not timed apart it is inside backward, so
    # compute stays whole and only the recompute share itself is unknown
    affected = {"data_load_ns": ("input", "residual"), "wait_ns": ("residual",), "h2d_ns": ("h2d",),
                "recompute_ns": ("recompute",)}.get(column, ("compute", column.removesuffix("_ns")))
    for component in affected:
        assert window.ranks[lacking].share(component, 0.5) is None
        if ranks > 1:
            assert window.ranks[0].share(component, 0.5) is not None
    diagnosis = diagnose(rows)
    incomplete = [v for v in diagnosis.step_time if v.name == "INCOMPLETE_DATA"]
    if column == "recompute_ns":
        assert window.ranks[lacking].share("compute", 0.5) is not None and not incomplete
        return
    assert incomplete and lacking in incomplete[0].ranks
    for verdict in diagnosis.step_time:
        if verdict.name in ("INPUT_BOUND", "H2D_BOUND", "RESIDUAL_HEAVY", "COMPUTE_BOUND"):
            assert str(lacking) not in verdict.evidence.get("share_per_rank", {}) or \
                verdict.evidence["share_per_rank"][str(lacking)] is not None
        assert lacking not in verdict.ranks or verdict.name == "INCOMPLETE_DATA" or "STRAGGLER" not in verdict.name
    assert not any("STRAGGLER" in v.name for v in diagnosis.step_time)


@settings(max_examples=examples(100), deadline=None)
@given(st.permutations(list(range(40))))
def test_row_order_does_not_matter(order: list[int]) -> None:
    rows = steps(0, 20, fetch=2.0) + steps(1, 20, forward=5.0)
    assert diagnose([rows[i] for i in order]).to_dict() == diagnose(rows).to_dict()


def check_window(rows: list[Any], window: int | None, expected: tuple[int, ...] = ()) -> None:
    """The numpy window of ``rows`` is the reference's, as rows and as the store's tuples."""
    want = oracle.window(rows, window, expected)
    got = build_window(rows, window, expected_ranks=expected)
    _same_window(got, want)
    # as the history gives them: SQLite stores a bool as its int
    stored = [{k: int(v) if type(v) is bool else v for k, v in r.items()} for r in rows if isinstance(r, dict)]
    tuples = [tuple(r.get(c) for c in STEP_ORDER) for r in stored]
    from_store = build_window(StepColumns.from_tuples(tuples), window, expected_ranks=expected)
    _same_window(from_store, oracle.window(stored, window, expected))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-3)


def _same_window(got: Any, want: oracle.Window) -> None:
    assert (got.first_step, got.last_step, got.rows_ignored, got.ranks_without_steps) == \
        (want.first_step, want.last_step, want.rows_ignored, want.ranks_without_steps)
    assert sorted(got.ranks) == sorted(want.ranks)
    for rank, b in want.ranks.items():
        a = got.ranks[rank]
        assert (a.steps, a.first_step, a.last_step, a.start_ns, a.end_ns) == \
            (b.steps, b.first_step, b.last_step, b.start_ns, b.end_ns)
        assert a.known == b.known
        for name in b.sums:
            assert _close(a.sums[name], b.sums[name]), name
            assert _close(a.denominators[name], b.denominators[name]), name
        assert _close(a.step_total_ns, b.step_total_ns)
        assert (a.between_ns is None) == (b.between_ns is None)
        if b.between_ns is not None:
            assert _close(a.between_ns, b.between_ns) and _close(a.between_wall_ns, b.between_wall_ns)
        clocks = [(n, s if k else None) for n, s, k in zip(a.step_numbers.tolist(), a.step_starts.tolist(),
                                                           a.starts_known.tolist())]
        assert clocks == b.clocks
        for value in (a.rank, a.steps, a.first_step, a.last_step, a.start_ns, a.end_ns, a.between_ns):
            assert value is None or type(value) in (int, float)  # plain JSON numbers, no numpy scalar


def check_facts(samples: list[Any], rows: list[Any], window: int | None = None) -> None:
    """The numpy memory facts of ``samples`` are the reference's."""
    got = memory_facts(samples, build_window(rows, window))
    want = oracle.facts(samples, oracle.window(rows, window))
    for name in ("kind", "samples", "peaks", "totals", "hosts", "counts", "host_ranks"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("host_used", "rss"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.keys() == w.keys() and all(_close(g[k], w[k]) for k in w), name
    assert len(got.worst) == len(want.worst) and all(map(_close, got.worst, want.worst))
    assert len(got.median) == len(want.median) and all(map(_close, got.median, want.median))
    assert sorted(got.own.ranks()) == sorted(want.own) or not want.own
    for rank, series in want.own.items():
        assert got.own[rank] == series


STEP_ORDER = ("rank", "step", "start_ns", "end_ns", "step_ns", *STEP_COLUMNS)
edge = st.sampled_from([2**63, 2.0**63, 2**64, 2**63 - 1, -1, -1.0, math.nan, math.inf, -math.inf, True, False,
                        "5", 1.5, 0, 0.0, T0, float(T0), numpy.float64(2.5), numpy.float64(-1.0)])
number = st.one_of(st.none(), st.integers(0, 10_000_000), st.floats(0, 1e7), edge)
clock = st.one_of(st.none(), st.integers(0, 1_000_000_000), st.integers(T0, T0 + 10**9), edge)
plausible_row = st.fixed_dictionaries(
    {"rank": st.one_of(st.integers(0, 3), edge), "step": st.one_of(st.integers(0, 30), edge),
     "step_ns": st.one_of(st.integers(0, 20_000_000), edge)},
    optional={"start_ns": clock, "end_ns": clock, **dict.fromkeys(STEP_COLUMNS, number)},
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(plausible_row, max_size=80), st.one_of(st.none(), st.integers(1, 20)),
       st.lists(st.integers(0, 5), max_size=3))
@example(rows=[], window=None, expected=[0, 2])  # empty: every expected rank without steps
@example(rows=[{"rank": 0, "step": 0, "step_ns": 5, "start_ns": 2**63, "end_ns": 2**64},  # past int64: unknown
               {"rank": 0, "step": 1, "step_ns": 5, "start_ns": 2.0**63, "end_ns": -1}], window=None, expected=[])
@example(rows=[{"rank": 0, "step": 0, "step_ns": 5, "start_ns": T0 + 1, "end_ns": T0 + 7},  # exact ns clocks, one unknown
               {"rank": 0, "step": 1, "step_ns": 5, "start_ns": T0 + 9, "end_ns": None}], window=None, expected=[])
@example(rows=[{"rank": 0, "step": 3, "step_ns": 5, "forward_ns": 1},  # a (rank, step) twice: the later wins
               {"rank": 0, "step": 3, "step_ns": 7, "forward_ns": math.nan}], window=1, expected=[])
def test_the_window_is_the_reference_window(rows: list, window: int | None, expected: list[int]) -> None:
    check_window(rows, window, tuple(expected))


@settings(max_examples=examples(200), deadline=None)
@given(any_rows, st.one_of(st.none(), st.integers(1, 50)))
def test_the_window_of_any_rows_is_the_reference_window(rows: list, window: int | None) -> None:
    want = oracle.window(rows, window)
    _same_window(build_window(rows, window), want)


mem_number = st.one_of(st.none(), st.integers(0, 80 << 30), edge)
mem_sample = st.fixed_dictionaries({
    "rank": st.one_of(st.integers(0, 3), edge), "timestamp_ns": st.one_of(st.integers(0, 1_200_000_000), edge),
    "collector": st.sampled_from(["stepwatch.cpu_tracker", "stepwatch.cuda_tracker", "stepwatch.nvml_tracker", 3]),
    "device_id": st.one_of(st.integers(-1, 2), edge), "allocated": mem_number, "reserved": mem_number,
    "free": mem_number, "total": st.one_of(st.none(), st.integers(0, 80 << 30), edge),
    "host": st.sampled_from(["a", "b", None]),
}, optional={"event_type": st.sampled_from(["sample", "stop"])})


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 3), st.integers(1, 120), st.lists(st.one_of(mem_sample, st.none()), max_size=120),
       st.one_of(st.none(), st.integers(1, 40)))
def test_the_memory_facts_are_the_reference_facts(ranks: int, count: int, samples: list, window: int | None) -> None:
    rows: list[dict[str, Any]] = []
    for rank in range(ranks):
        rows += [{**r, "start_ns": r["start_ns"] // 10, "end_ns": r["end_ns"] // 10}
                 for r in steps(rank, count, t0=0)]
    check_facts(samples, rows, window)
    json.dumps(diagnose(rows, samples).to_dict(), allow_nan=False)  # plain JSON: no numpy scalar, no NaN


def test_a_sample_taken_as_a_step_starts_belongs_to_that_step() -> None:
    rows = [r for rank in range(2) for r in steps(rank, 30, t0=0)]
    samples = [{"rank": r["rank"], "timestamp_ns": r["start_ns"], "collector": "stepwatch.cpu_tracker",
                "device_id": -1, "allocated": (1 << 30) + r["step"] * (1 << 20), "reserved": 0, "free": 1 << 33,
                "total": 1 << 34, "host": "a"} for r in rows]
    check_facts(samples, rows)
    found = memory_facts(samples, build_window(rows, None))
    # each sample is its own step's: the series grows by a step's 1 MiB from the first step on
    assert len(found.worst) == 30 and found.worst[1] - found.worst[0] == 1 << 20


def test_a_sample_one_nanosecond_before_a_step_at_real_clocks_is_the_step_before() -> None:
    """Clocks near today's (~1.8e18 ns) stay exact, also where some are unknown: a float64 would
    round them to 256 ns and move the sample into the next step."""
    rows = [r for rank in range(2) for r in steps(rank, 10)]
    rows[5] = {**rows[5], "end_ns": None}  # one unknown clock
    samples = [{"rank": r["rank"], "timestamp_ns": r["start_ns"] - 1, "collector": "stepwatch.cpu_tracker",
                "device_id": -1, "allocated": (1 << 30) + r["step"] * (1 << 20), "reserved": 0, "free": 1 << 33,
                "total": 1 << 34, "host": "a"} for r in rows if r["step"] > 0]
    check_facts(samples, rows)
    found = memory_facts(samples, build_window(rows, None))
    # the sample of step n (taken 1 ns before it starts) is step n-1's: steps 0..8 hold one each
    assert len(found.worst) == 9 and found.worst[0] == (1 << 30) + (1 << 20)


def test_the_own_device_on_a_tie_is_the_lowest() -> None:
    rows = steps(0, 60, t0=0)
    samples = [{"rank": 0, "timestamp_ns": r["start_ns"] + 1, "collector": "stepwatch.cuda_tracker", "device_id": d,
                "allocated": 1 << 30, "reserved": 2 << 30, "free": 0, "total": 80 << 30, "host": "a"}
               for r in rows for d in (1, 0)]
    check_facts(samples, rows)
    found = memory_facts(samples, build_window(rows, None))
    assert found.kind == "device" and found.samples == 60  # device 0's, not both


@pytest.mark.parametrize("clock", [2**63, 2.0**63, 2**64, -1, math.nan, True])
def test_a_clock_past_int64_or_no_clock_is_unknown(clock: Any) -> None:
    rows = [r for rank in range(2) for r in steps(rank, 10, t0=0)]
    rows[0] = {**rows[0], "start_ns": clock}
    rows[9] = {**rows[9], "end_ns": clock}
    rows[4] = {**rows[4], "end_ns": clock}
    samples = [{"rank": rank, "timestamp_ns": 1_000 + i, "collector": "stepwatch.cpu_tracker", "device_id": -1,
                "allocated": 1 << 30, "reserved": 0, "free": 1 << 33, "total": 1 << 34, "host": "a"}
               for rank in range(2) for i in range(150)]
    check_window(rows, None)
    check_facts(samples, rows)
    built = build_window(rows, None)
    assert built.ranks[0].start_ns is None and built.ranks[0].end_ns is None
    assert built.ranks[1].start_ns == 0
    # the two pairs that lose a clock (4-5 and nothing else on rank 0: 9 is the last) are left out
    assert built.ranks[0].between_ns is not None
    json.dumps(diagnose(rows, samples).to_dict(), allow_nan=False)


@pytest.mark.parametrize("junk", [math.nan, -1, -0.5, math.inf, True, "5", 2**63, [1]])
def test_a_phase_that_is_no_number_is_unknown_never_a_value(junk: Any) -> None:
    rows = steps(0, 30) + steps(1, 30)
    for r in rows:
        if r["rank"] == 1:
            r["forward_ns"] = junk
    built = build_window(rows, None)
    assert built.ranks[1].known["forward"] == 0 and built.ranks[1].share("compute", 0.5) is None
    assert built.ranks[0].known["forward"] == 30
    check_window(rows, None)
    incomplete = [v for v in diagnose(rows).step_time if v.name == "INCOMPLETE_DATA"]
    assert incomplete and 1 in incomplete[0].ranks


@pytest.mark.parametrize(("step", "step_ns"), [(True, True), ("3", "3"), (-1, -1), (2.5, math.inf),
                                                (math.nan, math.nan), (2**53, 2**63)])
def test_a_row_whose_step_or_time_is_no_number_is_ignored_and_counted(step: Any, step_ns: Any) -> None:
    rows = steps(0, 10) + [{"rank": 0, "step": step, "step_ns": 5}, {"rank": 0, "step": 11, "step_ns": step_ns},
                           None, "row"]
    built = build_window(rows, None)
    assert built.rows_ignored == 4 and built.ranks[0].steps == 10
    check_window(rows, None)


def test_empty_input() -> None:
    assert build_window([], None, expected_ranks=(0, 1)).ranks_without_steps == (0, 1)
    diagnosis = diagnose([], [], [], expected_ranks=(0, 1))
    assert diagnosis.primary.name == "INSUFFICIENT_STEP_TIME_DATA"
    assert memory_facts([], build_window(steps(0, 5), None)).kind == ""
    assert memory_facts([], build_window([], None)).kind == ""
    check_window([], None, (3,))
    check_facts([], steps(0, 5))


def test_step_columns_read_back_as_the_rows_they_hold() -> None:
    rows = steps(0, 3) + [{"rank": 1, "step": 0, "step_ns": 5, "start_ns": None, "end_ns": 2**63, "forward_ns": -1}]
    columns = StepColumns.from_rows(rows)
    back = list(columns)
    assert back[0]["start_ns"] == rows[0]["start_ns"] and back[0]["forward_ns"] == rows[0]["forward_ns"]
    assert back[3]["start_ns"] is None and back[3]["end_ns"] is None and back[3]["forward_ns"] is None
    assert columns.span() == (rows[0]["start_ns"], rows[2]["end_ns"])


@pytest.mark.real
def test_the_engine_imports_numpy_only_when_it_runs() -> None:
    """numpy is a dependency of the reductions, never of ``import``: the surfaces that import the
    engine (the CLI, the aggregator) stay light until they judge a run."""
    code = ("import sys; import stepwatch.analysis.verdicts, stepwatch.analysis.bundle_risks; "
            "assert 'numpy' not in sys.modules; stepwatch.analysis.verdicts.diagnose([]); "
            "assert 'numpy' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
