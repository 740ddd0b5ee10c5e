"""The live view's data (``stepwatch.views.live``): one real 2-rank run under ``stepwatch run``,
watched while it trains by a ``LiveReader`` in this process (tests/support/live_runs.py, shared
with the drawing's tests); what the reader shows agrees with the history the aggregator wrote. A
``track`` run killed mid-run, with no history, is lost and gets the engine's own verdict. The
folding rule and the readers of damaged files are property-tested."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.artifacts.alerts_log import AlertLog
from stepwatch.views.live import FOLD_ABOVE, LiveReader, LiveSnapshot, RankLive, fold_ranks, named_ranks
from stepwatch.views.live.reader import SUMMARY_GRACE_S
from tests.support import STEPWATCH, clean_env
from tests.support.live_program import TOTAL
from tests.support.live_runs import Killed, Watched, killed_run, watched_run


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Watched:
    return watched_run(tmp_path_factory)


def _history_steps(run_dir: Path, rank: int) -> list[dict[str, int]]:
    db = sqlite3.connect(run_dir / "history.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT * FROM steps WHERE rank = ? ORDER BY step", (rank,))]
    finally:
        db.close()


@pytest.mark.real
def test_the_run_trains_and_ends_well(watched: Watched) -> None:
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert watched.final.ended


# -- a run with no history, killed: ``stepwatch track``, its program SIGKILLed mid-run --------------
# (second in the file: parallel workers take tests in turn, so one builds this run while another
# builds the watched one, instead of waiting for it)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    return killed_run(tmp_path_factory)


@pytest.mark.real
def test_a_killed_rank_is_lost_and_its_run_over(killed: Killed) -> None:
    assert not (killed.run_dir / "history.sqlite").exists()  # track keeps no history
    later = LiveReader(killed.run_dir, clock=lambda: time.time() + 60)  # its silence, a minute on
    try:
        snapshot = later.snapshot()
    finally:
        later.close()
    (rank,) = snapshot.ranks
    assert rank.state == "lost" and killed.killed_at_step <= (rank.step or 0) < TOTAL
    assert snapshot.ended


@pytest.mark.real
def test_a_run_with_no_history_gets_the_engines_verdict_on_its_ledger(killed: Killed) -> None:
    assert any(s.ranks and s.ranks[0].state == "running" for s in killed.during)
    reader = LiveReader(killed.run_dir)
    try:
        verdict = reader.snapshot().verdict
    finally:
        reader.close()
    explained = subprocess.run([*STEPWATCH, "explain", str(killed.run_dir), "--window", "100", "--json"],
                               env=clean_env(), capture_output=True, text=True, timeout=120)
    assert explained.returncode == 0, explained.stderr
    primary = json.loads(explained.stdout)["diagnosis"]["primary"]
    if primary["name"] in ("WARMUP", "INSUFFICIENT_STEP_TIME_DATA"):
        assert verdict is None
    else:  # the same engine on the same last 100 steps: the same verdict
        assert verdict is not None and (verdict["name"], verdict["ranks"]) == (primary["name"], primary["ranks"])


# -- the watched run, read while it trained and after --------------------------------------------


@pytest.mark.real
def test_a_reader_sees_the_run_while_it_trains(watched: Watched) -> None:
    moving = [s for s in watched.during if len(s.ranks) == 2 and s.ranks[0].state == "running" and s.step]
    assert moving, [(s.step, [r.state for r in s.ranks]) for s in watched.during]
    assert any(0 < (s.step or 0) < TOTAL for s in moving)  # caught mid-run
    steps = [s.step for s in moving]
    assert steps == sorted(steps)  # the step only goes forward
    fresh = [r.heartbeat_age_s for s in moving for r in s.ranks if r.state == "running"]
    assert all(age is not None and age < 5 for age in fresh), fresh
    assert any(s.total_steps == TOTAL for s in moving)  # the plan was known while it trained
    assert any(s.ranks[0].memory_kind == "rss" and (s.ranks[0].memory_bytes or 0) > 10 * 2**20 for s in moving)


@pytest.mark.real
def test_the_final_snapshot_agrees_with_the_history(watched: Watched) -> None:
    assert [r.rank for r in watched.final.ranks] == [0, 1]
    for rank in watched.final.ranks:
        rows = _history_steps(watched.run_dir, rank.rank)
        assert rank.state == "stopped"
        assert rank.step == rows[-1]["step"] + 1 == TOTAL
        window = rows[-100:]
        assert rank.step_time_s == pytest.approx(statistics.median(r["step_ns"] for r in window) / 1e9)
        span = (window[-1]["end_ns"] - window[0]["end_ns"]) / 1e9
        assert rank.steps_per_s == pytest.approx((len(window) - 1) / span)
        total = sum(r["step_ns"] for r in window)
        assert rank.phase_shares["forward"] == pytest.approx(sum(r["forward_ns"] for r in window) / total)
        assert rank.phase_shares["optimizer"] == pytest.approx(sum(r["optimizer_ns"] for r in window) / total)
        assert sum(rank.phase_shares.values()) == pytest.approx(1.0, abs=0.02)
    assert watched.final.total_steps == TOTAL
    # the job's figures: its slowest rank's
    assert watched.final.step_time_s == max(r.step_time_s for r in watched.final.ranks)  # type: ignore[type-var]
    assert watched.final.steps_per_s == min(r.steps_per_s for r in watched.final.ranks)  # type: ignore[type-var]


@pytest.mark.real
def test_memory_and_its_peak_are_the_history_samples(watched: Watched) -> None:
    db = sqlite3.connect(watched.run_dir / "history.sqlite")
    try:
        for rank in watched.final.ranks:
            (peak,), = db.execute("SELECT MAX(allocated) FROM telemetry WHERE rank = ? AND event_type = 'sample'",
                                  (rank.rank,))
            (last,), = db.execute("SELECT allocated FROM telemetry WHERE rank = ? AND event_type = 'sample' "
                                  "ORDER BY timestamp_ns DESC LIMIT 1", (rank.rank,))
            assert (rank.memory_kind, rank.memory_peak_bytes, rank.memory_bytes) == ("rss", peak, last)
    finally:
        db.close()


@pytest.mark.real
def test_the_ended_runs_verdict_is_its_diagnosis(watched: Watched) -> None:
    summary = json.loads((watched.run_dir / "final_summary.json").read_text())
    primary = summary["diagnosis"]["primary"]
    assert watched.final.verdict is not None
    assert (watched.final.verdict["name"], watched.final.verdict["message"]) == (primary["name"], primary["message"])


@pytest.mark.real
def test_a_run_ends_with_its_summary_not_before(watched: Watched, tmp_path: Path) -> None:
    # stepwatch run writes run.json's end, then the summary (which reads run.json): a reader
    # between the two saw an ended run with no verdict, and `top` ended on "no verdict yet"
    copy = tmp_path / "run"
    shutil.copytree(watched.run_dir, copy)
    summary = (copy / "final_summary.json").read_bytes()
    (copy / "final_summary.json").unlink()
    ended_at = json.loads((copy / "run.json").read_text())["ended_at_ns"] / 1e9

    def snapshot_at(now: float) -> Any:
        reader = LiveReader(copy, clock=lambda: now)
        try:
            return reader.snapshot()
        finally:
            reader.close()

    assert not snapshot_at(ended_at + 1).ended
    assert snapshot_at(ended_at + SUMMARY_GRACE_S + 1).ended  # a summary that never comes
    (copy / "final_summary.json").write_bytes(summary)
    final = snapshot_at(ended_at + 1)
    assert final.ended and final.verdict is not None
    assert final.verdict["name"] == json.loads(summary)["diagnosis"]["primary"]["name"]


@pytest.mark.real
def test_an_alert_names_its_rank_and_is_never_folded(watched: Watched, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(watched.run_dir, copy)
    AlertLog(copy).append({"ts": time.time(), "kind": "STALL", "severity": "crit", "ranks": [0], "step": 7,
                           "message": "rank 0 made no progress", "session_id": watched.final.session_id})
    AlertLog(copy).append({"ts": time.time(), "kind": "STALL", "severity": "crit", "ranks": [5], "step": 7,
                           "message": "another session's", "session_id": "someone-else"})
    reader = LiveReader(copy)
    try:
        snapshot = reader.snapshot()
    finally:
        reader.close()
    assert [a["message"] for a in snapshot.alerts] == ["rank 0 made no progress"]
    assert 0 in named_ranks(snapshot)


@pytest.mark.real
def test_a_run_without_ledgers_is_read_from_its_heartbeats(watched: Watched, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(watched.run_dir, copy)
    shutil.rmtree(copy / "ledger")  # as a run captured before the ledger, or on a full disk
    reader = LiveReader(copy)
    try:
        ranks = reader.snapshot().ranks
    finally:
        reader.close()
    assert [(r.rank, r.step, r.state, r.memory_kind) for r in ranks] == [(0, TOTAL, "stopped", "rss"),
                                                                          (1, TOTAL, "stopped", "rss")]


# -- the folding rule --------------------------------------------------------------------------


_rank_lists = st.lists(
    st.tuples(st.one_of(st.none(), st.floats(0.0, 10.0, allow_nan=False)), st.one_of(st.none(), st.integers(0, 10**6))),
    min_size=0, max_size=80,
).map(lambda items: [RankLive(rank=i, step_time_s=t, step=s) for i, (t, s) in enumerate(items)])


@given(_rank_lists, st.sets(st.integers(0, 100), max_size=6))
def test_folding_keeps_the_extremes_the_median_and_the_named(ranks: list[RankLive], named: set[int]) -> None:
    shown = fold_ranks(ranks, named)
    numbers = [r.rank for r in shown]
    assert numbers == sorted(set(numbers))  # by rank, each once
    assert set(numbers) <= {r.rank for r in ranks}
    if len(ranks) <= FOLD_ABOVE:
        assert shown == sorted(ranks, key=lambda r: r.rank)
        return
    present_named = named & {r.rank for r in ranks}
    assert present_named <= set(numbers)
    assert len(shown) <= 3 + len(present_named)
    timed = [r for r in ranks if r.step_time_s is not None]
    if len(timed) == len(ranks):
        assert max(r.step_time_s for r in shown) == max(r.step_time_s for r in timed)  # type: ignore[type-var]
        assert min(r.step_time_s for r in shown) == min(r.step_time_s for r in timed)  # type: ignore[type-var]
        ordered = sorted(r.step_time_s for r in timed)  # type: ignore[type-var]
        assert ordered[len(ordered) // 2] in {r.step_time_s for r in shown}
    else:  # a rank with no step time yet is as slow as it gets: one of them is shown
        assert any(r.step_time_s is None for r in shown)


def test_named_ranks_come_from_the_verdict_and_the_alerts() -> None:
    snapshot = LiveSnapshot(run_dir="r", session_id="s", taken_at=0.0,
                            verdict={"name": "STRAGGLER", "ranks": [3]},
                            alerts=({"kind": "STALL", "ranks": [7, "x"]}, {"kind": "NONFINITE", "ranks": None}))
    assert named_ranks(snapshot) == {3, 7}
    # a finding on every rank of the run names none in particular: the table still folds
    everyone = tuple(RankLive(rank=r) for r in range(40))
    wide = LiveSnapshot(run_dir="r", session_id="s", taken_at=0.0, ranks=everyone,
                        verdict={"name": "BETWEEN_STEPS", "ranks": list(range(40))}, alerts=({"kind": "X", "ranks": [5]},))
    assert named_ranks(wide) == {5}


# -- damaged files ---------------------------------------------------------------------------


@given(ledger=st.binary(max_size=2000), alerts=st.binary(max_size=500), segment=st.binary(max_size=500),
       run_json=st.binary(max_size=200), spool=st.binary(max_size=300))
def test_damaged_files_never_raise(ledger: bytes, alerts: bytes, segment: bytes, run_json: bytes, spool: bytes) -> None:
    from stepwatch.artifacts.step_ledger import HEADER, HEADER_SIZE, MAGIC

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "ledger").mkdir()
        (run / "ledger" / "rank0-1.steps").write_bytes(ledger)
        # a whole header over damaged records, too
        header = HEADER.pack(MAGIC, 2, 88, 8, 1, 2, 1, 0, 0, b"s").ljust(HEADER_SIZE, b"\0")
        (run / "ledger" / "rank1-2.steps").write_bytes(header + ledger)
        (run / "alerts.jsonl").write_bytes(alerts)
        (run / "telemetry" / "rank0").mkdir(parents=True)
        (run / "telemetry" / "rank0" / "segment-000001.jsonl").write_bytes(segment + b"\n")
        (run / "run.json").write_bytes(run_json)
        (run / "spool").mkdir()
        (run / "spool" / f"{1:020d}-x.json").write_bytes(spool)
        (run / "history.sqlite").write_bytes(spool)
        reader = LiveReader(run)
        try:
            snapshot = reader.snapshot()
        finally:
            reader.close()
        assert all(r.rank in (0, 1) for r in snapshot.ranks)


# -- the ledger's window, against the ledger's own reader ------------------------------------------


@given(writes=st.lists(st.integers(0, 40), min_size=1, max_size=6), capacity=st.sampled_from([8, 16, 64]),
       size=st.integers(1, 100))
def test_the_ledger_window_is_the_last_records_the_ledger_holds(writes: list[int], capacity: int, size: int) -> None:
    from stepwatch.artifacts.step_ledger import StepLedger, read_ledger
    from stepwatch.views.live.ledger import MappedLedger

    with tempfile.TemporaryDirectory() as tmp:
        ledger = StepLedger.create(Path(tmp), "s", rank=0, capacity=capacity)
        reader = None
        step = 0
        try:
            for burst in writes:  # the reader looks between bursts, as a refresh does
                for _ in range(burst):
                    ledger.write(step, 10 + step * 100, 60 + step * 100, {"forward": 7, "backward": step})
                    step += 1
                if reader is None:
                    reader = MappedLedger(next((Path(tmp) / "ledger").iterdir()))
                window = reader.window(size)
                expected = read_ledger(reader.path).records[-size:]
                assert [int(i) for i in window["index"]] == [r.index for r in expected]
                assert [int(e) for e in window["end"]] == [r.end_ns for r in expected]
                assert [tuple(int(v) for v in p) for p in window["phases"]] == [r.phases for r in expected]
        finally:
            if reader is not None:
                reader.close()
            ledger.close(1)


# -- from the history alone: a ``serve --out`` directory of many sessions ----------------------------


@pytest.mark.real
def test_a_history_alone_shows_the_same_ranks_and_picks_its_session(watched: Watched, killed: Killed,
                                                                    tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(watched.run_dir / "history.sqlite", hub / "history.sqlite")
    imported = subprocess.run([*STEPWATCH, "import", str(killed.run_dir), "--into", str(hub / "history.sqlite")],
                              env=clean_env(), capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    reader = LiveReader(hub, watched.final.session_id)
    try:
        snapshot = reader.snapshot()
    finally:
        reader.close()
    assert len(snapshot.ranks) == 2
    for rank, own in zip(snapshot.ranks, watched.final.ranks, strict=True):
        # the same steps, read from the history instead of the ledger: the same figures
        assert (rank.rank, rank.step, rank.state, rank.memory_kind, rank.memory_peak_bytes) == (
            own.rank, own.step, "stopped", own.memory_kind, own.memory_peak_bytes)
        assert rank.step_time_s == pytest.approx(own.step_time_s)
        assert rank.steps_per_s == pytest.approx(own.steps_per_s)
        assert rank.phase_shares == pytest.approx(own.phase_shares)
    assert snapshot.ended
    for session, step in ((watched.final.session_id, TOTAL), (None, None)):
        shown = subprocess.run([*STEPWATCH, "top", str(hub), "--once", *(["--session", session] if session else [])],
                               env=clean_env(), capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        row = shown.stdout.splitlines()[2].split()
        assert row[0] == "0" and (step is None or row[1] == str(step)), shown.stdout


def test_a_ledger_cut_under_the_reader_is_mapped_anew_not_read_past_its_end(tmp_path: Path) -> None:
    from stepwatch.artifacts.step_ledger import StepLedger

    ledger = StepLedger.create(tmp_path, "s", rank=0, capacity=1024)
    for step in range(50):
        ledger.write(step, 10 + step * 100, 60 + step * 100, None)
    reader = LiveReader(tmp_path, "s")
    try:
        assert [r.step for r in reader.snapshot().ranks] == [50]
        os.truncate(ledger.path, 128)  # its pages past the header are gone: reading them would be SIGBUS
        assert reader.snapshot().ranks == ()
    finally:
        reader.close()
        ledger.close(1)
