"""The files behind halt, stack dumps and memory snapshots, read and written without a job:
the halt step formula, the refusals, the parsers (property tests: any bytes give a request or an
ArtifactError naming the file, never anything else), the CLI's bad-input lines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.halt import (
    HALT_FILENAME,
    HaltRefused,
    HaltRequest,
    choose_halt_step,
    parse_halt,
    read_halt,
    request_halt,
)
from stepwatch.artifacts.heartbeat import heartbeat_record
from stepwatch.artifacts.live_ranks import RankProcess, live_ranks, rank_processes
from stepwatch.artifacts.memory_snapshots import (
    parse_memory_snapshot_request,
    read_memory_snapshot_answers,
    request_memory_snapshot,
)
from stepwatch.artifacts.stacks import NoStackDump, dump_stacks
from stepwatch.errors import ArtifactError
from tests.support import examples

STEPWATCH = [sys.executable, "-m", "stepwatch"]


def _rank(name: str = "rank0", step: int = 100, rate: float | None = 10.0, ts: float = 1000.0,
          poll_s: float | None = 1.0) -> RankProcess:
    return RankProcess(rank=int(name[4:].split("-")[0]), name=name, pid=1, host=None, session_id=None,
                       booted_at=0.0, stopped=False, step=step, step_ts=ts, steps_per_s=rate, stack_signal=None,
                       stack_file=None, poll_s=poll_s, heartbeat=Path("x"))


def _write_heartbeat(run: Path, rank: int, records: list[dict[str, object]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / f"heartbeat_rank{rank}.jsonl", "ab") as file:
        for record in records:
            file.write(msgspec.json.encode(record) + b"\n")


def _live_run(run: Path, *, steps: tuple[int, ...] = (40, 42), host: str | None = None) -> None:
    """Heartbeat files of ranks that are this very process (alive), stepping at 10 steps/s."""
    now = time.time()
    booted = psutil.Process().create_time() + 0.01  # after this process started: not a reused pid
    for rank, step in enumerate(steps):
        records = [heartbeat_record(ts=booted, pid=os.getpid(), rank=rank, step=0, msg="boot",
                                    host=host or socket.gethostname(), session_id="s-1", poll_s=1.0)]
        records += [heartbeat_record(ts=now - 10 + i, pid=os.getpid(), rank=rank, step=step - 10 * (10 - i),
                                     msg="heartbeat") for i in range(1, 11)]
        _write_heartbeat(run, rank, records)


# -- the halt step ------------------------------------------------------------------------------


def test_the_chosen_step_is_ahead_of_where_every_rank_will_be_when_it_reads_the_file() -> None:
    # rank 1 is ahead and faster; both last seen 1 s ago; lead = 2 * 1 + 2 = 4 s
    ranks = [_rank("rank0", step=100, rate=10.0, ts=999.0), _rank("rank1", step=104, rate=12.0, ts=999.0)]
    target, basis = choose_halt_step(ranks, now=1000.0)
    assert basis["lead_s"] == 4.0
    assert target == 104 + int(12.0 * 5) + 1  # 165: rank 1 reaches 164 within the lead
    assert basis["ranks"]["rank1"]["reach"] == 164.0


def test_a_rank_with_no_rate_yet_is_halted_at_its_next_step() -> None:
    target, _ = choose_halt_step([_rank(step=0, rate=None)], now=1000.0)
    assert target == 1


def test_the_slowest_poll_period_sets_the_lead() -> None:
    _, basis = choose_halt_step([_rank(poll_s=1.0), _rank("rank1", poll_s=5.0)], now=1000.0)
    assert basis["lead_s"] == 12.0


def test_request_halt_chooses_from_live_ranks_and_writes_the_file_atomically(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    ranks = live_ranks(run)
    assert [(r.rank, r.step, round(r.steps_per_s or 0)) for r in ranks] == [(0, 40, 10), (1, 42, 10)]
    request = request_halt(run, reason="test")
    assert request.chosen and request.target_step > 42 and request.session_id == "s-1"
    assert read_halt(run) == request
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == [HALT_FILENAME]  # no temp file left


def test_an_at_step_already_passed_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    with pytest.raises(HaltRefused, match="already passed: rank 1 has completed step 42"):
        request_halt(run, at_step=42)
    assert read_halt(run) is None
    assert request_halt(run, at_step=43).target_step == 43


def test_an_alert_action_keeps_a_pending_halt_of_its_session(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    first = request_halt(run, at_step=100, reason="by hand")
    # --on-nonfinite halt after it: the ranks keep going to step 100, not to a new step
    assert request_halt(run, reason="NONFINITE: loss", keep_pending=True) == first
    assert read_halt(run) == first
    (run / ".HALT").write_text(first.__class__.__name__)  # damaged: replaced
    assert request_halt(run, at_step=120, keep_pending=True).target_step == 120
    other = msgspec.structs.replace(read_halt(run), session_id="an-older-session")  # type: ignore[arg-type]
    (run / ".HALT").write_bytes(msgspec.json.encode(other))  # another session's: replaced
    assert request_halt(run, at_step=130, keep_pending=True).target_step == 130


def test_no_running_rank_to_choose_from_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    _write_heartbeat(run, 0, [heartbeat_record(ts=time.time(), pid=os.getpid(), rank=0, step=40, msg="stop")])
    _write_heartbeat(run, 1, [heartbeat_record(ts=time.time(), pid=os.getpid(), rank=1, step=42, msg="stop")])
    assert live_ranks(run) == []
    with pytest.raises(HaltRefused, match="no rank is running"):
        request_halt(run)
    assert request_halt(run, at_step=50).target_step == 50  # a job not started yet may be told in advance


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not a run directory"):
        request_halt(tmp_path)
    with pytest.raises(ArtifactError, match="no such directory"):
        dump_stacks(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="not a directory"):
        request_memory_snapshot(tmp_path / "file", reason="x")


def test_ranks_on_another_host_are_read_but_not_signalled(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run, host="another-node")
    assert [r.local for r in rank_processes(run)] == [False, False]
    with pytest.raises(NoStackDump, match="runs on host another-node, not this one"):
        dump_stacks(run)


def test_a_rank_that_registered_no_signal_is_never_signalled(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)  # this test process: SIGUSR2 would kill it
    with pytest.raises(NoStackDump, match="registered no stack dump signal"):
        dump_stacks(run, ranks=[0])


# -- the CLI on bad input ----------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "FORCE_COLOR", "COLUMNS"))}
    return subprocess.run([*STEPWATCH, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.real
def test_cli_bad_input_is_one_error_line_and_exit_code_2(tmp_path: Path) -> None:
    for args in (["halt", str(tmp_path)], ["dump-stacks", str(tmp_path / "nope")],
                 ["memory-snapshot", str(tmp_path), "--wait", "0"]):
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("error:") and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.real
def test_cli_halt_into_a_run_directory_it_cannot_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    (run / HALT_FILENAME).mkdir()  # the name is taken by a directory: the write fails whoever runs it
    result = _cli("halt", str(run), "--at-step", "100")
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and "cannot write" in result.stderr and ".HALT" in result.stderr


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_cli_halt_into_a_read_only_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    run.chmod(0o555)
    try:
        result = _cli("halt", str(run), "--at-step", "100")
    finally:
        run.chmod(0o755)
    assert result.returncode == 2 and result.stderr.startswith("error:") and "cannot write" in result.stderr


@pytest.mark.real
def test_cli_dump_stacks_with_no_rank_that_can_be_dumped_exits_3(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run, host="another-node")
    result = _cli("dump-stacks", str(run))
    assert result.returncode == 3
    assert result.stderr.startswith("error:") and "another-node" in result.stderr


# -- parsers (property tests) ----------------------------------------------------------------------------

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=10)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=300) | _json_values.map(lambda v: json.dumps(v).encode()) | st.fixed_dictionaries(
    {"target_step": st.integers(-5, 10**6), "reason": st.text(max_size=20), "requested_at": st.floats(0, 2e9),
     "iso": st.just("x"), "by": st.just("me")}).map(lambda v: json.dumps(v).encode()))
def test_a_halt_file_is_a_request_or_an_error_naming_it(data: bytes) -> None:
    path = Path("/run/.HALT")
    try:
        request = parse_halt(data, path)
    except ArtifactError as exc:
        assert str(path) in str(exc)
    else:
        assert isinstance(request, HaltRequest) and request.target_step >= 1


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=300) | _json_values.map(lambda v: json.dumps(v).encode()))
def test_a_memory_snapshot_request_is_a_request_or_an_error_naming_it(data: bytes) -> None:
    path = Path("/run/.MEMORY_SNAPSHOT")
    try:
        parse_memory_snapshot_request(data, path)
    except ArtifactError as exc:
        assert str(path) in str(exc)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.binary(max_size=80) | _json_values.map(lambda v: json.dumps(v).encode()), max_size=12))
def test_any_heartbeat_file_reads_as_rank_processes_without_raising(tmp_path_factory: pytest.TempPathFactory,
                                                                   lines: list[bytes]) -> None:
    run = tmp_path_factory.mktemp("run")
    boot = msgspec.json.encode(heartbeat_record(ts=1.0, pid=123, rank=0, step=0, msg="boot"))
    (run / "heartbeat_rank0.jsonl").write_bytes(b"\n".join([boot, *lines]))
    found = rank_processes(run)
    assert len(found) <= 1
    for process in found:
        assert isinstance(process.step, int) and isinstance(process.pid, int)


def test_memory_snapshot_answers_are_read_per_request(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _live_run(run)
    request = request_memory_snapshot(run, reason="HIGH_PRESSURE")
    assert request.session_id == "s-1"
    answers = run / "memory_snapshots" / "rank0.answers.jsonl"
    answers.parent.mkdir()
    answers.write_bytes(b'{"request_id": "other", "ts": 1}\nnot json\n'
                        + msgspec.json.encode({"request_id": request.request_id, "ts": 2, "status": "no_cuda"}) + b"\n")
    assert [a["status"] for a in read_memory_snapshot_answers(run, request.request_id)] == ["no_cuda"]
    assert len(read_memory_snapshot_answers(run)) == 2


def test_a_stall_inside_the_window_does_not_slow_the_rate_a_halt_step_is_chosen_from(tmp_path: Path) -> None:
    from stepwatch.artifacts.live_ranks import _fastest_rate

    # 20 steps at 50 steps/s, an 8 s stall, then 20 more at 50 steps/s
    points = [(i, i * 0.02) for i in range(20)] + [(20 + i, 8.4 + i * 0.02) for i in range(20)]
    assert _fastest_rate(points) == pytest.approx(50.0)
    assert _fastest_rate(points[:1]) is None
