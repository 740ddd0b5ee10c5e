"""The compare verdict (analysis/compare.py): a pure rule over two summaries, property-tested."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.analysis.compare import EXIT_FINE, EXIT_INCONCLUSIVE, EXIT_REGRESSION, compare_verdict
from tests.support import examples

VERDICTS = {"REGRESSION", "IMPROVEMENT", "MIXED", "EQUIVALENT", "INCONCLUSIVE"}
SWAPPED = {"REGRESSION": "IMPROVEMENT", "IMPROVEMENT": "REGRESSION", "MIXED": "MIXED", "EQUIVALENT": "EQUIVALENT",
           "INCONCLUSIVE": "INCONCLUSIVE"}


def summary(median: float | None, steps: int = 200, data_load: float | None = 0.1, peak: int | None = 100 << 20,
            world: int | None = 1) -> dict[str, Any]:
    return {"world_size": world, "overall": {"steps": steps, "step_ms": {"median": median},
                                             "phase_share": {"data_load": data_load, "h2d": 0.0, "forward": 0.4,
                                                             "wait": 0.05}},
            "memory_peaks": [] if peak is None else [{"peak_allocated_bytes": peak}]}


numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**12),
                    st.booleans(), st.text(max_size=3))
junk = st.recursive(numbers, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.sampled_from(
                                                        ["overall", "steps", "step_ms", "median", "phase_share",
                                                         "data_load", "wait", "memory_peaks", "world_size",
                                                         "peak_allocated_bytes"]), inner, max_size=5)), max_leaves=20)
real = st.builds(summary, st.floats(0.01, 1e4), st.integers(0, 5000), st.one_of(st.none(), st.floats(0, 1)),
                 st.one_of(st.none(), st.integers(1, 2**40)), st.sampled_from([1, 2]))


@settings(max_examples=examples(300), deadline=None)
@given(junk, junk, st.one_of(st.none(), st.floats(0, 1000)))
def test_any_input_gives_a_verdict_and_an_exit_code(a: Any, b: Any, threshold: float | None) -> None:
    result = compare_verdict(a if isinstance(a, dict) else {"overall": a}, b if isinstance(b, dict) else {},
                             max_step_time_regression_pct=threshold)
    assert result["verdict"] in VERDICTS
    assert result["exit_code"] in (EXIT_FINE, EXIT_INCONCLUSIVE, EXIT_REGRESSION)
    assert (result["exit_code"] == EXIT_INCONCLUSIVE) == (result["verdict"] == "INCONCLUSIVE")
    assert result["reasons"]


@settings(max_examples=examples(300), deadline=None)
@given(real, real)
def test_swapping_the_runs_swaps_the_verdict(a: dict[str, Any], b: dict[str, Any]) -> None:
    forward, backward = compare_verdict(a, b), compare_verdict(b, a)
    assert backward["verdict"] == SWAPPED[forward["verdict"]]


@settings(max_examples=examples(200), deadline=None)
@given(real)
def test_a_run_against_itself_is_equivalent_or_inconclusive(a: dict[str, Any]) -> None:
    result = compare_verdict(a, a, max_step_time_regression_pct=0.0)
    expected = "INCONCLUSIVE" if a["overall"]["steps"] < 20 else "EQUIVALENT"
    assert result["verdict"] == expected
    assert result["exit_code"] == (EXIT_INCONCLUSIVE if expected == "INCONCLUSIVE" else EXIT_FINE)


@settings(max_examples=examples(200), deadline=None)
@given(st.floats(0.1, 100), st.floats(-0.5, 2.0), st.floats(0, 50))
def test_exit_4_exactly_when_the_step_time_rises_past_the_threshold(median: float, change: float,
                                                                      threshold: float) -> None:
    result = compare_verdict(summary(median), summary(median * (1 + change)), max_step_time_regression_pct=threshold)
    relative = result["changes"]["step_time_median_ms"]["relative"]
    assert result["exit_code"] == (EXIT_REGRESSION if relative * 100 > threshold else EXIT_FINE)
    if relative > 0.03:
        assert result["verdict"] == "REGRESSION"
    elif relative < -0.03:
        assert result["verdict"] == "IMPROVEMENT"
    else:
        assert result["verdict"] == "EQUIVALENT"


def test_the_step_time_band_is_plus_or_minus_three_percent() -> None:
    assert compare_verdict(summary(10.0), summary(10.29))["verdict"] == "EQUIVALENT"
    assert compare_verdict(summary(10.0), summary(10.31))["verdict"] == "REGRESSION"
    assert compare_verdict(summary(10.0), summary(9.69))["verdict"] == "IMPROVEMENT"


def test_faster_but_more_memory_is_mixed() -> None:
    result = compare_verdict(summary(10.0, peak=100 << 20), summary(8.0, peak=200 << 20))
    assert result["verdict"] == "MIXED" and result["signals"] == {"step_time": "better", "stall_share": "same",
                                                                   "memory": "worse"}


def test_more_time_waiting_for_data_is_a_regression_at_the_same_speed() -> None:
    result = compare_verdict(summary(10.0, data_load=0.05), summary(10.0, data_load=0.40))
    assert result["verdict"] == "REGRESSION" and result["exit_code"] == EXIT_FINE


def test_inconclusive_reasons() -> None:
    few = compare_verdict(summary(10.0, steps=5), summary(10.0))
    assert few["verdict"] == "INCONCLUSIVE" and "too few steps in A: 5" in few["reasons"][0]
    world = compare_verdict(summary(10.0, world=1), summary(10.0, world=2))
    assert world["verdict"] == "INCONCLUSIVE" and "world size 1 vs 2" in world["reasons"][0]
    script = compare_verdict(summary(10.0), summary(10.0), workload_a="a.py", workload_b="b.py")
    assert script["verdict"] == "INCONCLUSIVE" and "a.py vs b.py" in script["reasons"][0]
    none = compare_verdict(summary(None), summary(10.0))
    assert none["verdict"] == "INCONCLUSIVE" and "no step time" in none["reasons"][-1]
