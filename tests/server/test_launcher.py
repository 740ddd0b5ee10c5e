"""``stepwatch run`` end to end (torchrun, gloo, two ranks, the aggregator as its own process), and
the history commands over what it writes: ``summary``, ``compare``, ``import``."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from stepwatch.artifacts.heartbeat import read_heartbeat
from stepwatch.artifacts.sink import TelemetrySink
from stepwatch.artifacts.spool import read_spool
from stepwatch.artifacts.telemetry_loader import load_telemetry_sessions
from tests.support import STEPWATCH, clean_env, free_port, run_stepwatch
from tests.support.aggregator import query
from tests.support.marks import own_marks
from tests.support.shared import once
from tests.support.trace_run import STEPS_PER_RANK, trace_run_with_output

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "train_demo.py"


def run_command(out: Path, *script: str, nproc: int = 2) -> list[str]:
    return [*STEPWATCH, "run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--interval", "200",
            "--out", str(out), *script]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A 2-rank run that logs a loss mark each step (the exports' run, tests/support/trace_run.py)."""
    return trace_run_with_output(tmp_path_factory)


@pytest.fixture(scope="module")
def track_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build(base: Path) -> Path:
        out = base / "track-run"
        proc = run_stepwatch("track", "--interval", "100", "--out", str(out), "--", sys.executable, str(DEMO),
                             "--steps", "30", cwd=base, timeout=90)
        assert proc.returncode == 0, proc.stderr
        assert not (out / "history.sqlite").exists()
        return out

    return once(tmp_path_factory, "launcher-track", build)


def test_two_rank_run_completes_with_history_and_summary(two_ranks: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, proc = two_ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "[stepwatch] aggregator on 127.0.0.1:" in proc.stderr
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["world_size"] == 2 and manifest["launcher"] == "run"
    sid = manifest["session_id"]

    store = out / "history.sqlite"
    for table in ("telemetry", "spans", "steps", "marks", "heartbeats"):
        ranks = dict(query(store, f"SELECT rank, COUNT(*) FROM {table} WHERE session_id = ? GROUP BY rank", (sid,)))
        assert set(ranks) == {0, 1}, (table, ranks)
    steps = dict(query(store, "SELECT rank, COUNT(*) FROM steps WHERE session_id = ? GROUP BY rank", (sid,)))
    assert steps == {0: STEPS_PER_RANK, 1: STEPS_PER_RANK}
    losses = dict(query(store, "SELECT rank, COUNT(*) FROM marks WHERE session_id = ? AND name = 'loss' "
                        "AND json_extract(attrs, '$.inferred') IS NULL GROUP BY rank",
                        (sid,)))
    assert losses == {0: STEPS_PER_RANK, 1: STEPS_PER_RANK}
    (status, world), = query(store, "SELECT status, world_size FROM sessions WHERE session_id = ?", (sid,))
    assert (status, world) == ("completed", 2)
    stats = json.loads((out / "aggregator_stats.json").read_text())
    assert stats["rejected"] == {} and stats["rows_written"] == stats["rows_accepted"] > 0 and stats["ranks"] == 2

    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["schema_version"] and summary["session_id"] == sid and summary["status"] == "completed"
    assert summary["ranks"] == [0, 1] and summary["world_size"] == 2
    assert set(summary["per_rank"]) == {"0", "1"}
    assert all(summary["per_rank"][r]["steps"] == STEPS_PER_RANK for r in ("0", "1"))
    overall = summary["overall"]
    assert overall["steps"] == 2 * STEPS_PER_RANK
    ms = overall["step_ms"]
    assert 0 < ms["median"] <= ms["p90"] <= ms["p99"] <= ms["max"]
    step_ms = [n / 1e6 for (n,) in query(store, "SELECT step_ns FROM steps WHERE session_id = ?", (sid,))]
    assert ms["median"] == pytest.approx(statistics.median(step_ms))
    assert ms["p90"] == pytest.approx(statistics.quantiles(step_ms, n=10, method="inclusive")[-1])
    shares = overall["phase_share"]
    assert set(shares) == {"data_load", "h2d", "forward", "backward", "optimizer", "recompute", "wait"}
    assert all(0 <= v <= 1 for v in shares.values()) and shares["forward"] > 0 and shares["backward"] > 0
    # the measured phases never exceed the step (wait is the residual; it may include data_load,
    # see aggregator-architecture.md: wait = step - h2d - forward - backward - optimizer)
    assert sum(v for k, v in shares.items() if k != "wait") <= 1.0 + 1e-3
    # the wait share excludes the step's own fetch, so the six shares partition the step time
    assert 0.98 <= sum(shares.values()) <= 1.0 + 1e-3
    # the run's rate is its slowest rank's: every rank does each step
    assert overall["throughput_steps_per_s"] == min(r["throughput_steps_per_s"] for r in summary["per_rank"].values())
    assert summary["exit_code"] == 0
    peaks = {p["rank"]: p for p in summary["memory_peaks"]}
    assert set(peaks) == {0, 1} and all(p["peak_allocated_bytes"] > 0 for p in peaks.values())
    assert summary["counts"]["telemetry"] > 0 and summary["counts"]["spans"] > 0

    text = (out / "final_summary.txt").read_text()
    assert f"session {sid}" in text and "rank 0:" in text and "rank 1:" in text and "p99" in text
    assert text in proc.stdout  # printed at the end of the run


def test_failing_script_exit_code_is_passed_through(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    proc = subprocess.run(run_command(tmp_path / "run", str(script), nproc=1), cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "about to fail" in proc.stdout
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["exit_code"] == 3
    assert "exit code 3" in proc.stderr
    summary = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert summary["exit_code"] == 3
    assert "exit code 3" in (tmp_path / "run" / "final_summary.txt").read_text()


def test_training_outlives_a_killed_aggregator(tmp_path: Path) -> None:
    out = tmp_path / "run-killed"
    steps = 240  # 80 per epoch per rank
    launcher = subprocess.Popen(run_command(out, str(DEMO), "--steps", str(steps)), cwd=tmp_path, env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        aggregator = None
        end = time.monotonic() + 60
        while aggregator is None and time.monotonic() < end:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                try:
                    if "stepwatch.server" in child.cmdline():
                        aggregator = child
                except psutil.Error:
                    pass
            time.sleep(0.05)
        assert aggregator is not None, "no aggregator process under the launcher"
        store = out / "history.sqlite"

        def both_ranks_arrived() -> bool:
            try:
                return len(query(store, "SELECT DISTINCT rank FROM telemetry")) == 2
            except sqlite3.Error:
                return False

        while not both_ranks_arrived() and time.monotonic() < end:
            time.sleep(0.1)
        assert both_ranks_arrived()
        aggregator.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert time.monotonic() - killed_at < 90
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    sid = manifest["session_id"]

    # the local artifacts are the complete record
    per_rank = steps // 3 * 3
    spool = read_spool(out)
    for rank in (0, 1):
        ledger = TelemetrySink(out / "telemetry" / f"rank{rank}").ledger
        assert ledger[-1].session_id == sid and ledger[-1].status == "completed"
        beats = read_heartbeat(out / f"heartbeat_rank{rank}.jsonl")
        assert beats[0]["msg"] == "boot" and beats[-1]["msg"] == "stop" and beats[-1]["status"] == "completed"
        rank_steps = [s for s in spool.spans if s["name"] == "step" and s.get("rank") == rank]
        assert sorted(s["index"] for s in rank_steps) == list(range(per_rank))
        span_ids = {s["id"] for s in spool.spans if s.get("rank") == rank}
        assert sum(1 for m in own_marks(spool) if m["name"] == "loss" and m["span_id"] in span_ids) == per_rank
    sessions = load_telemetry_sessions(out)
    events = [e for s in sessions if s.summary.session_id == sid for e in s.events]
    assert {e.rank for e in events if e.event_type == "stop"} == {0, 1}
    # what reached the aggregator before it died is kept; the history is rebuilt from the local
    # artifacts, so the final summary counts every step
    assert "aggregator died" in stderr
    assert not (out / "aggregator_stats.json").exists()
    partial = out / "history.partial.sqlite"
    assert len(query(partial, "SELECT DISTINCT rank FROM telemetry")) == 2
    assert query(partial, "SELECT COUNT(*) FROM telemetry")[0][0] < len(events)
    history = out / "history.sqlite"
    assert query(history, "SELECT COUNT(*) FROM telemetry WHERE session_id = ?", (sid,)) == [(len(events),)]
    assert dict(query(history, "SELECT rank, COUNT(*) FROM steps GROUP BY rank")) == {0: per_rank, 1: per_rank}
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["session_id"] == sid and summary["status"] == "completed"
    assert summary["overall"]["steps"] == 2 * per_rank
    assert {r: s["steps"] for r, s in summary["per_rank"].items()} == {"0": per_rank, "1": per_rank}


def test_summary_commands(two_ranks: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    out, _ = two_ranks
    saved = json.loads((out / "final_summary.json").read_text())
    text = run_stepwatch("summary", str(out), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert text.stdout == (out / "final_summary.txt").read_text()
    as_json = run_stepwatch("summary", str(out), "--json", cwd=tmp_path)
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == saved
    # recomputed from the store alone: the same numbers
    fresh = json.loads(run_stepwatch("summary", str(out / "history.sqlite"), "--json", cwd=tmp_path).stdout)
    for key in ("session_id", "status", "ranks", "world_size", "overall", "per_rank", "memory_peaks", "counts"):
        assert fresh[key] == saved[key], key
    chosen = json.loads(run_stepwatch("summary", str(out), "--session", saved["session_id"], "--json", cwd=tmp_path).stdout)
    assert chosen["overall"] == saved["overall"]


def test_compare_two_runs(two_ranks: tuple[Path, subprocess.CompletedProcess[str]], track_run: Path,
                          tmp_path: Path) -> None:
    out, _ = two_ranks
    a = json.loads((out / "final_summary.json").read_text())
    b = json.loads(run_stepwatch("summary", str(track_run), "--json", cwd=tmp_path).stdout)
    proc = run_stepwatch("compare", str(out), str(track_run), "--json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr  # 2 ranks against 1: different workloads, inconclusive
    result = json.loads(proc.stdout)
    assert result["verdict"]["verdict"] == "INCONCLUSIVE" and "world size 2 vs 1" in result["verdict"]["reasons"][-1]
    rows = {r["metric"]: r for r in result["metrics"]}
    assert rows["steps"]["a"] == 2 * STEPS_PER_RANK and rows["steps"]["b"] == b["overall"]["steps"] == 30
    assert rows["steps"]["delta"] == 30 - 2 * STEPS_PER_RANK
    assert rows["steps"]["relative"] == pytest.approx((30 - 2 * STEPS_PER_RANK) / (2 * STEPS_PER_RANK))
    median = rows["step_ms.median"]
    assert median["a"] == a["overall"]["step_ms"]["median"] and median["b"] == b["overall"]["step_ms"]["median"]
    assert median["delta"] == pytest.approx(median["b"] - median["a"])
    assert {"step_ms.p90", "step_ms.p99", "throughput_steps_per_s", "phase_share.forward",
            "memory_peak_allocated_bytes"} <= set(rows)
    table = run_stepwatch("compare", str(out), str(track_run), cwd=tmp_path)
    assert table.returncode == 3 and "verdict INCONCLUSIVE: " in table.stdout
    assert "step_ms.median" in table.stdout and "throughput_steps_per_s" in table.stdout and "%" in table.stdout


def test_import_a_track_run_and_summarise_it(track_run: Path, tmp_path: Path) -> None:
    target = tmp_path / "new.sqlite"
    proc = run_stepwatch("import", str(track_run), "--into", str(target), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = json.loads(proc.stdout)
    sid = json.loads((track_run / "run.json").read_text())["session_id"]
    events = [e for s in load_telemetry_sessions(track_run) for e in s.events]
    spool = read_spool(track_run)
    beats = read_heartbeat(track_run / "heartbeat_rank0.jsonl")
    assert written["telemetry"] == len(events) > 0
    assert written["spans"] == len(spool.spans) > 0
    assert written["marks"] == len(spool.marks) and len(own_marks(spool)) == 30
    assert written["heartbeats"] == len(beats) > 0
    assert written["steps"] == 30
    for table, n in (("telemetry", len(events)), ("spans", len(spool.spans)), ("marks", len(spool.marks)),
                     ("heartbeats", len(beats)), ("steps", 30)):
        assert query(target, f"SELECT COUNT(*) FROM {table} WHERE session_id = ?", (sid,)) == [(n,)], table
    # importing again stores nothing twice where ids exist
    run_stepwatch("import", str(track_run), "--into", str(target), cwd=tmp_path)
    assert query(target, "SELECT COUNT(*) FROM spans") == [(len(spool.spans),)]
    assert query(target, "SELECT COUNT(*) FROM marks") == [(len(spool.marks),)]

    via_temp = run_stepwatch("summary", str(track_run), "--json", cwd=tmp_path)
    assert via_temp.returncode == 0, via_temp.stderr
    assert not (track_run / "history.sqlite").exists()
    summary = json.loads(via_temp.stdout)
    assert summary["session_id"] == sid and summary["overall"]["steps"] == 30 and summary["ranks"] == [0]
    from_store = json.loads(run_stepwatch("summary", str(target), "--json", cwd=tmp_path).stdout)
    assert from_store["overall"]["step_ms"] == summary["overall"]["step_ms"]
    text = run_stepwatch("summary", str(track_run), cwd=tmp_path)
    assert text.returncode == 0 and "steps 30" in text.stdout


def test_training_runs_when_the_aggregator_cannot_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "run"
        proc = subprocess.run([*STEPWATCH, "run", "--port", str(port), "--interval", "200", "--out", str(out),
                               str(DEMO), "--steps", "12"], cwd=tmp_path, env=clean_env(), capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "aggregator did not start" in proc.stderr + proc.stdout
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["status"] == "completed"
    assert query(out / "history.sqlite", "SELECT count(*) FROM steps")[0][0] > 0


SLOW_LAST_NODE = """
import os, sys, time
sys.argv[1:] = ["--steps", "12"]
exec(open({demo!r}).read().replace('if __name__ == "__main__":', 'if True:'))
if os.environ["GROUP_RANK"] == "1":
    time.sleep(3)  # node 1 ends well after node 0, whose launcher must wait for it
"""


def test_two_nodes_share_one_history_on_node_zero(tmp_path: Path) -> None:
    """Two `stepwatch run` launchers on loopback, as two nodes: node 0 hosts the aggregator,
    node 1 reaches it by address, one session id for both."""
    script = tmp_path / "two_nodes.py"
    script.write_text(SLOW_LAST_NODE.format(demo=str(DEMO)))
    sid, port, master = "5e55e55e-0000-4000-8000-000000000002", free_port(), free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
              "--session-id", sid, "--interval", "200"]
    node0 = subprocess.Popen([*STEPWATCH, "run", *common, "--node-rank", "0", "--port", str(port),
                              "--out", str(tmp_path / "node0"), str(script)], cwd=tmp_path, env=clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node1 = subprocess.Popen([*STEPWATCH, "run", *common, "--node-rank", "1", "--aggregator", f"127.0.0.1:{port}",
                              "--out", str(tmp_path / "node1"), str(script)], cwd=tmp_path, env=clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = node0.communicate(timeout=180)
    out1, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 0, err0[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    store = tmp_path / "node0" / "history.sqlite"
    stops = query(store, "SELECT DISTINCT rank FROM telemetry WHERE session_id = ? AND event_type = 'stop'", (sid,))
    assert sorted(r for (r,) in stops) == [0, 1]  # node 1's last records arrived before node 0 closed
    steps = dict(query(store, "SELECT rank, COUNT(*) FROM steps WHERE session_id = ? GROUP BY rank", (sid,)))
    assert set(steps) == {0, 1} and steps[0] == steps[1] > 0
    summary = json.loads((tmp_path / "node0" / "final_summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["world_size"] == 2
    assert not (tmp_path / "node1" / "history.sqlite").exists()  # node 1 keeps only its local artifacts
    assert (tmp_path / "node1" / "telemetry" / "rank1").is_dir()


def test_a_busy_port_is_one_error_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print('trained')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*STEPWATCH, "run", "--port", str(port), "--out", str(tmp_path / "run"), "job.py"],
                              cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "trained" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"error: cannot listen for frames on 127.0.0.1:{port}" in proc.stderr
