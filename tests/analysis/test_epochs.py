"""Which epoch an evaluation belongs to (analysis/epochs.py): the one that holds it, else the one
it follows, before the rank's next epoch starts or the run ends (hypothesis, against a plain
reference)."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stepwatch.analysis.epochs import epoch_report, eval_owner, render_epoch_line
from tests.support import examples

US = 1000  # times on a microsecond grid: the report's milliseconds (3 decimals) are exact


def _covered_us(intervals: list[tuple[int, int]]) -> int:
    return len({t for a, b in intervals for t in range(a, b)})


@st.composite
def _rank_run(draw: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(epochs one after another, evaluation steps anywhere from before the first to after the
    last), in microseconds."""
    epochs = []
    t = draw(st.integers(0, 50))
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.integers(0, 60))
        epochs.append((t, t + length))
        t += length + draw(st.integers(0, 60))
    evals = []
    for _ in range(draw(st.integers(0, 12))):
        start = draw(st.integers(0, t + 50))
        evals.append((start, start + draw(st.integers(0, 40))))
    return epochs, evals


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(_rank_run(), min_size=1, max_size=3))
@example([([(0, 10), (30, 40)], [(12, 20), (22, 35), (45, 50), (5, 8)])])  # after, into the next, after the last
@example([([(0, 0)], []), ([(0, 2), (20, 20)], [(0, 20)])])  # inside and after: 2 + 18 ms, rounded apart
def test_evaluation_belongs_to_the_epoch_that_holds_or_precedes_it(ranks: list[Any]) -> None:
    spans: list[dict[str, Any]] = []
    for rank, (epochs, evals) in enumerate(ranks):
        spans += [{"rank": rank, "name": "epoch", "idx": i, "start_ns": a * US, "end_ns": b * US}
                  for i, (a, b) in enumerate(epochs)]
        spans += [{"rank": rank, "name": "eval_step", "start_ns": a * US, "end_ns": b * US} for a, b in evals]
    report = epoch_report(spans)
    assert report is not None
    listed = {(e["rank"], e["index"]): e for e in report["epochs"]}
    for rank, (epochs, evals) in enumerate(ranks):
        after_ms = 0.0
        for i, (start, end) in enumerate(epochs):
            following = epochs[i + 1][0] if i + 1 < len(epochs) else None
            mine = [(a, b) for a, b in evals if start <= a and (following is None or a < following)]
            clipped = [(a, b if following is None else min(b, following)) for a, b in mine]
            entry = listed[(rank, i)]
            assert entry["eval_steps"] == len(mine)
            assert entry["eval_ms"] == _covered_us(clipped) / 1000
            assert entry["eval_after_ms"] == _covered_us([(max(a, end), b) for a, b in clipped]) / 1000
            assert entry["eval_ms"] <= entry["duration_ms"] + entry["eval_after_ms"] + 1e-9
            after_ms += entry["eval_after_ms"]
        # evaluation before the first epoch is no epoch's
        assert sum(listed[(rank, i)]["eval_steps"] for i in range(len(epochs))) == \
            sum(1 for a, _ in evals if a >= epochs[0][0])
        assert report["per_rank"][str(rank)]["eval_after_ms"] == round(after_ms, 3)
    share = report["eval_ms"]["share"]
    assert share is None or 0.0 <= share <= 1.0
    line = render_epoch_line(report)
    assert line is not None and (("eval none" in line) == (report["eval_ms"]["total"] == 0))


_epoch = st.tuples(st.integers(0, 100), st.integers(0, 100), st.one_of(st.none(), st.integers(0, 5)))


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(_epoch, min_size=1, max_size=6), st.integers(-10, 220))
def test_an_evaluation_has_one_owner_started_before_it(raw: list[tuple[int, int, Any]], at: int) -> None:
    """Overlapping and nested epochs too: the owner started at or before the evaluation, holds it
    if any epoch does (the latest started of those), and there is none only before every epoch."""
    epochs = sorted(((a, a + n, i) for a, n, i in raw), key=lambda e: (e[0], e[1], e[2] is None, e[2] or 0))
    owner = eval_owner(epochs, at)
    started = [e for e in epochs if e[0] <= at]
    if not started:
        assert owner is None
        return
    assert owner is not None and epochs[owner][0] <= at
    holding = [e for e in started if at < e[1]]
    if holding:
        assert at < epochs[owner][1] and epochs[owner][0] == max(e[0] for e in holding)
    else:
        assert epochs[owner][1] == max(e[1] for e in started)
