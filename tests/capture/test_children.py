"""Processes the training process starts itself are captured into its session (real processes
under ``stepwatch run``): the DDP tutorial's ranks started by ``torch.multiprocessing.spawn``,
Hogwild workers started by ``mp.Process``; DataLoader workers stay out."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stepwatch.capture.children import ChildProcess, settle_identity
from stepwatch.capture.identity import DistributedIdentity
from tests.support import STEPWATCH, free_port

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

PROGRAMS = Path(__file__).resolve().parent / "programs"


def _env() -> dict[str, str]:
    drop = ("STEPWATCH_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "FORCE_COLOR", "COLUMNS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _run(tmp_path: Path, program: str, *args: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path / "run"
    proc = subprocess.run([*STEPWATCH, "run", "--interval", "200", "--out", str(out), str(PROGRAMS / program), *args],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def _steps_per_rank(out: Path) -> dict[int, int]:
    db = sqlite3.connect(f"{(out / 'history.sqlite').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT rank, COUNT(*) FROM steps GROUP BY rank").fetchall())
    finally:
        db.close()


def _start_processes(out: Path) -> dict[int, list[dict[str, Any]]]:
    db = sqlite3.connect(f"{(out / 'history.sqlite').resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT rank, metadata FROM telemetry WHERE event_type = 'start'").fetchall()
    finally:
        db.close()
    found: dict[int, list[dict[str, Any]]] = {}
    for rank, metadata in rows:
        found.setdefault(rank, []).append(json.loads(metadata).get("process") or {"role": "main"})
    return found


def test_ddp_ranks_started_by_mp_spawn_are_ranks_of_their_world(tmp_path: Path) -> None:
    out, proc = _run(tmp_path, "ddp_spawn.py", str(free_port()))
    assert _steps_per_rank(out) == {0: 12, 1: 12}  # 3 epochs x 4 batches per rank, the peeks no steps
    summary = json.loads((out / "final_summary.json").read_text())
    assert (summary["ranks"], summary["world_size"], summary["workers"]) == ([0, 1], 2, [])
    assert {rank: stats["steps"] for rank, stats in summary["per_rank"].items()} == {"0": 12, "1": 12}
    assert "ranks [0, 1] of world size 2" in proc.stdout
    assert json.loads((out / "run.json").read_text())["world_size"] == 2
    processes = _start_processes(out)
    for rank in (0, 1):
        spawned = [p for p in processes[rank] if p["role"] == "rank"]
        assert len(spawned) == 1 and spawned[0]["identity_source"] == "init_process_group"
        assert (spawned[0]["rank"], spawned[0]["world_size"], spawned[0]["start_method"]) == (rank, 2, "spawn")
    # the process that started the ranks holds rank 0's claim: the spawned rank 0 keeps its own files
    names = sorted(p.name for p in (out / "telemetry").iterdir())
    assert names[0] == "rank0" and names[2] == "rank1" and re.fullmatch(r"rank0-p\d+", names[1]), names


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_hogwild_workers_are_captured_and_named(tmp_path: Path, start_method: str) -> None:
    out, proc = _run(tmp_path, "hogwild.py", start_method)
    assert _steps_per_rank(out) == {1: 16, 2: 16}  # the parent only tests (eval steps)
    summary = json.loads((out / "final_summary.json").read_text())
    assert (summary["ranks"], summary["world_size"], summary["workers"]) == ([0], 1, [1, 2])
    assert "ranks [0] of world size 1, workers [1, 2]" in proc.stdout
    assert "worker 1: 16 steps" in proc.stdout and "worker 2: 16 steps" in proc.stdout
    processes = _start_processes(out)
    assert [p["role"] for p in processes[1] + processes[2]] == ["worker", "worker"]
    assert {p["start_method"] for p in processes[1] + processes[2]} == {start_method}
    assert json.loads((out / "run.json").read_text())["extra"]["workers"] == [1, 2]


@pytest.mark.parametrize("loader_start_method", ["fork", "spawn"])
def test_data_loader_workers_stay_out(tmp_path: Path, loader_start_method: str) -> None:
    out, _ = _run(tmp_path, "loader_workers.py", loader_start_method)
    # the process itself (16 steps) and the training worker it forked (8), none of the 4 loaders' workers
    assert _steps_per_rank(out) == {0: 16, 1: 8}
    assert sorted(p.name for p in (out / "telemetry").iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in out.glob("heartbeat_*")) == ["heartbeat_rank0.jsonl", "heartbeat_rank1.jsonl"]
    summary = json.loads((out / "final_summary.json").read_text())
    assert (summary["ranks"], summary["workers"]) == ([0], [1])


def _child(world_size: int = 1) -> ChildProcess:
    return ChildProcess(parent_identity=DistributedIdentity(world_size=world_size), parent_pid=os.getppid(),
                        start_method="fork", name="Process-1", spawn_index=None)


def test_worker_keys_skip_keys_already_claimed(tmp_path: Path) -> None:
    (tmp_path / ".autostart-s-rank1").write_text(str(os.getppid()))  # another process holds key 1
    (tmp_path / ".autostart-s-rank2").write_text("999999999")  # a dead one held key 2: never taken over
    child = _child()
    settle_identity(child, None, tmp_path, "s")
    assert child.identity is not None
    assert (child.role, child.identity.rank, child.identity.world_size, child.suffix) == ("worker", 3, 4, "")
    assert (tmp_path / ".autostart-s-rank3").read_text() == str(os.getpid())


def test_a_rank_held_by_another_process_keeps_its_own_files(tmp_path: Path) -> None:
    (tmp_path / ".autostart-s-rank0").write_text(str(os.getppid()))
    child = _child()
    settle_identity(child, DistributedIdentity(rank=0, world_size=2, source="init_process_group"), tmp_path, "s")
    assert (child.role, child.suffix) == ("rank", f"-p{os.getpid()}")
    other = _child()
    settle_identity(other, DistributedIdentity(rank=1, world_size=2, source="init_process_group"), tmp_path, "s")
    assert (other.role, other.suffix) == ("rank", "")
