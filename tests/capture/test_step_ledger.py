"""The step ledger: a rank killed by SIGKILL keeps every step it closed (real processes, a real
torch loop), and the reader never crashes on a cut or damaged file (property tests)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import examples

KILLED = """
import os, signal, sys, time, torch
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
for i in range(52):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(0.015)
model(x)  # the step in flight when the kill comes
open(sys.argv[1], "w").write("52")
os.kill(os.getpid(), signal.SIGKILL)
"""


def _env() -> dict[str, str]:
    drop = ("STEPWATCH_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "FORCE_COLOR", "COLUMNS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.mark.real
def test_a_rank_killed_by_sigkill_keeps_every_step_it_closed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = tmp_path / "run"
    proc = subprocess.run(check=False, args=[sys.executable, "-m", "stepwatch", "run", "--out", str(out), str(script), str(tmp_path / "done")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 137, proc.stderr
    done = int((tmp_path / "done").read_text())
    db = sqlite3.connect(out / "history.sqlite")
    try:
        steps = [row[0] for row in db.execute("SELECT step FROM steps ORDER BY step")]
    finally:
        db.close()
    assert steps == list(range(done)), f"{len(steps)} steps recorded of {done} done"
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["overall"]["steps"] == done
    tail = summary["unrecorded_tail"]["0"]  # the kill is said, not "drops: none"
    assert tail["last_step"] == done - 1 and tail["unrecorded_ms"] is not None
    text = (out / "final_summary.txt").read_text()
    assert "drops: none\n" not in text and "rank 0 ended without stopping its capture" in text
    # `stepwatch import` of the run directory reads the ledger too
    imported = subprocess.run(check=False, args=[sys.executable, "-m", "stepwatch", "import", str(out), "--into",
                                                 str(tmp_path / "again.sqlite")],
                              env=_env(), capture_output=True, text=True, timeout=60)
    assert imported.returncode == 0, imported.stderr
    db = sqlite3.connect(tmp_path / "again.sqlite")
    try:
        assert db.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == done
    finally:
        db.close()


def test_a_clean_stop_leaves_no_tail(tmp_path: Path) -> None:
    from stepwatch.artifacts.step_ledger import (
        StepLedger,
        read_ledger,
        unrecorded_tails,
    )

    ledger = StepLedger.create(tmp_path, "s1", rank=3, capacity=16)
    for i in range(40):  # wraps the ring twice: the last 16 remain
        ledger.write(i, 1_000 + i * 10, 1_005 + i * 10, {"forward": 1, "backward": 2, "optimizer_step": 1})
    path = ledger.path
    ledger.close(2_000)
    read = read_ledger(path)
    assert [r.index for r in read.records] == list(range(24, 40)) and read.skipped == 0
    assert read.rank == 3 and read.session_id == "s1" and read.closed_ns == 2_000
    assert unrecorded_tails(tmp_path, "s1") == {}


# -- the reader, on any bytes ----------------------------------------------------------------


def _valid_ledger(tmp_path: Path, steps: int, capacity: int) -> bytes:
    from stepwatch.artifacts.step_ledger import StepLedger

    ledger = StepLedger.create(tmp_path, "session-x", rank=0, capacity=capacity)
    for i in range(steps):
        ledger.write(i, 10 + i, 20 + i, None)
    data = ledger.path.read_bytes()
    ledger.close(1)
    ledger.path.unlink()
    return data


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.integers(0, 40), cut=st.integers(0, 4000), flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=12))
def test_cut_or_damaged_ledgers_give_a_clear_error_or_skipped_records(tmp_path: Path, steps: int, cut: int,
                                                                      flips: list[tuple[int, int]]) -> None:
    from stepwatch.artifacts.step_ledger import HEADER_SIZE, RECORD, read_ledger
    from stepwatch.errors import ArtifactError

    data = bytearray(_valid_ledger(tmp_path, steps, capacity=32))
    untouched = not flips and cut >= len(data)
    for at, value in flips:
        if at < len(data):
            data[at] = value
    data = data[:cut] if cut < len(data) else data
    path = tmp_path / "ledger.steps"
    path.write_bytes(bytes(data))
    try:
        read = read_ledger(path)
    except ArtifactError as exc:
        assert str(path) in str(exc)  # names the file
        return
    assert read.skipped >= 0
    for record in read.records:  # what is returned is whole: seq in its slot, times in order
        assert record.end_ns >= record.start_ns >= 0 and record.index >= 0
        assert (record.seq - 1) % read.capacity < (len(data) - HEADER_SIZE) // RECORD.size
    if untouched:
        assert [r.index for r in read.records] == list(range(max(0, steps - 32), steps)) and read.skipped == 0


@settings(max_examples=examples(100), deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_crash_the_reader(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    from stepwatch.artifacts.step_ledger import MAGIC, read_ledger
    from stepwatch.errors import ArtifactError

    path = tmp_path_factory.mktemp("blob") / "x.steps"
    path.write_bytes(MAGIC + blob if blob[:1] == b"\x01" else blob)
    try:
        read_ledger(path)
    except ArtifactError:
        pass


def test_a_record_cut_by_the_kill_is_skipped_and_counted(tmp_path: Path) -> None:
    from stepwatch.artifacts.step_ledger import HEADER_SIZE, RECORD, read_ledger

    data = bytearray(_valid_ledger(tmp_path, 5, capacity=8))
    # the kill came after the new seq and the times of record 6 were written, before its last seq
    RECORD.pack_into(data, HEADER_SIZE + 5 * RECORD.size, 6, 5, 100, 110, *[0] * (len(RECORD.format) - 6), 0)
    path = tmp_path / "cut.steps"
    path.write_bytes(bytes(data))
    read = read_ledger(path)
    assert [r.index for r in read.records] == [0, 1, 2, 3, 4] and read.skipped == 1
