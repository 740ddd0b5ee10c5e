"""The rules and readers behind a run's ``outcome`` (docs/run-outcome.md), property-tested."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.run_outcome import (
    OUTCOMES,
    decide_outcome,
    error_from_exception,
    error_from_signal,
    parse_torchrun_failures,
    read_rank_end,
    read_rank_ends,
    write_rank_end,
)
from stepwatch.errors import ArtifactError
from tests.support import examples

SID = "00000000-0000-4000-8000-000000000001"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _exception_error(rank: int, at_ns: int, typ: type[BaseException] = ValueError, fatal: bool = True) -> dict[str, Any]:
    try:
        raise typ("boom")
    except BaseException as exc:  # noqa: BLE001
        return error_from_exception(exc, exc.__traceback__, rank=rank, thread="MainThread", fatal=fatal, at_ns=at_ns)


def _end(rank: int, errors: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema_version": 1, "session_id": SID, "rank": rank, "outcome": "x", "errors": errors}


errors_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 10**12), st.sampled_from(["exc", "kbd", "thread", "term", "kill"])),
    max_size=6)


def _build(specs: list[tuple[int, int, str]]) -> dict[int, dict[str, Any]]:
    ends: dict[int, dict[str, Any]] = {}
    for rank, at_ns, kind in specs:
        if kind == "exc":
            error = _exception_error(rank, at_ns)
        elif kind == "kbd":
            error = _exception_error(rank, at_ns, KeyboardInterrupt)
        elif kind == "thread":
            error = _exception_error(rank, at_ns, fatal=False)
        else:
            error = error_from_signal(signal.SIGTERM if kind == "term" else signal.SIGKILL, rank=rank, at_ns=at_ns)
        ends.setdefault(rank, _end(rank, []))["errors"].append(error)
    return ends


@settings(max_examples=examples(200), deadline=None)
@given(errors_st, st.integers(-15, 3), st.lists(st.sampled_from([signal.SIGINT, signal.SIGTERM]), max_size=2),
       st.booleans())
def test_the_outcome_is_always_one_of_the_documented_set(specs: list[tuple[int, int, str]], returncode: int,
                                                         forwarded: list[int], single: bool) -> None:
    ends = _build(specs)
    outcome, error, errors = decide_outcome(returncode=returncode, rank_ends=ends, world_size=4, forwarded=forwarded,
                                            single_process=single, ended_at_ns=10**13)
    assert outcome in OUTCOMES and outcome not in ("running", "exited")
    assert error is None or error in errors
    assert [e["at_ns"] for e in errors] == sorted(e["at_ns"] for e in errors)  # by time
    if returncode == 0:
        assert outcome == "succeeded" and error is None
    elif signal.SIGINT in forwarded:
        assert outcome == "interrupted"
    elif signal.SIGTERM in forwarded:
        assert outcome == "halted"
    else:
        assert error is not None or outcome == "failed"
        if error is not None:  # the earliest fatal error decides
            assert error == min((e for e in errors if e["fatal"]), key=lambda e: e["at_ns"])


def test_the_first_rank_to_fail_decides_and_a_thread_error_does_not() -> None:
    ends = _build([(0, 300, "term"), (1, 200, "exc"), (0, 100, "thread")])
    outcome, error, errors = decide_outcome(returncode=1, rank_ends=ends, world_size=2, forwarded=[],
                                            single_process=False)
    assert outcome == "failed" and error is not None and error["rank"] == 1 and error["type"] == "ValueError"
    assert [e["rank"] for e in errors] == [0, 1, 0]


def test_a_mute_rank_under_torchrun_gets_its_signal_and_last_sign_of_life() -> None:
    ends = _build([(0, 500, "term")])
    failures = parse_torchrun_failures({"session_id": SID, "failures": [
        {"rank": 1, "exitcode": -9, "pid": 7, "at_ns": 10**9}, {"rank": 0, "exitcode": -15}]}, SID)
    outcome, error, _ = decide_outcome(returncode=1, rank_ends=ends, world_size=2, forwarded=[], single_process=False,
                                       torchrun_failures=failures, last_seen={1: 400})
    assert outcome == "killed" and error is not None
    assert (error["rank"], error["signal"], error["at_ns"], error["pid"]) == (1, "SIGKILL", 400, 7)


def test_a_child_killed_by_a_signal_is_rank_zero_killed() -> None:
    outcome, error, _ = decide_outcome(returncode=-9, rank_ends={}, world_size=1, forwarded=[], ended_at_ns=5)
    assert outcome == "killed" and error is not None and (error["rank"], error["signal"]) == (0, "SIGKILL")
    outcome, error, _ = decide_outcome(returncode=-2, rank_ends=_build([(0, 3, "kbd")]), world_size=1, forwarded=[])
    assert outcome == "interrupted" and error is not None and error["type"] == "KeyboardInterrupt"


@settings(max_examples=examples(200), deadline=None)
@given(json_values)
def test_torchrun_failures_from_any_json_never_raise(data: Any) -> None:
    for row in parse_torchrun_failures(data, SID) + parse_torchrun_failures({"session_id": SID, "failures": [data]}, SID):
        assert type(row["rank"]) is int and row["rank"] >= 0 and type(row["exitcode"]) is int


@settings(max_examples=examples(200), deadline=None)
@given(json_values)
def test_a_rank_end_file_of_any_json_reads_or_names_the_file(tmp_path_factory: pytest.TempPathFactory,
                                                             data: Any) -> None:
    path = tmp_path_factory.mktemp("end") / "outcome_rank0.json"
    path.write_text(json.dumps(data))
    try:
        record = read_rank_end(path)
    except ArtifactError as exc:
        assert str(path) in str(exc)
    else:
        assert isinstance(record["errors"], list) and isinstance(record["rank"], int)


def test_rank_end_files_round_trip_and_other_sessions_are_left_out(tmp_path: Path) -> None:
    write_rank_end(tmp_path, _end(0, [_exception_error(0, 1)]))
    write_rank_end(tmp_path, {**_end(1, []), "session_id": "another"})
    (tmp_path / "outcome_rank2.json").write_text("[" * 100_000)
    ends, problems = read_rank_ends(tmp_path, SID)
    assert list(ends) == [0] and ends[0]["errors"][0]["type"] == "ValueError"
    assert len(problems) == 1 and "outcome_rank2.json" in problems[0]
