"""``stepwatch serve --store clickhouse://...`` and ``run --store``: a real rank (a tiny torch
loop) ships to a real aggregator over TCP, which writes the history into Debian's real
clickhouse-server instead of history.sqlite; the same rows as the rank's own artifacts imported
into SQLite, the live verdicts read back from ClickHouse, and ``run``'s final summary built from it."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stepwatch.schema import new_session_id
from stepwatch.store import open_store
from stepwatch.store.importers import import_path
from stepwatch.store.sqlite import SqliteStore
from tests.support import STEPWATCH, clean_env, run_stepwatch

pytestmark = pytest.mark.real

pytest.importorskip("torch")

STEPS = 40

RANK = f'''
import sys
import torch
import stepwatch

stepwatch.init(out=sys.argv[1], interval=0.1, rank=0, local_rank=0, world_size=1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
'''


@pytest.fixture(scope="module")
def served(clickhouse_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("serve-clickhouse")
    url = clickhouse_server.database_url("served")
    (base / "rank.py").write_text(RANK)
    env = clean_env(STEPWATCH_VERDICT_INTERVAL_S="0.3")
    server = subprocess.Popen([*STEPWATCH, "serve", "--out", str(base / "hub"), "--port", "0", "--store", url,
                               "--ui-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        ready = json.loads(server.stdout.readline())
        session_id = new_session_id()
        rank = subprocess.run([sys.executable, str(base / "rank.py"), str(base / "rank0")], capture_output=True,
                              text=True, timeout=120,
                              env={**env, "STEPWATCH_AGGREGATOR": ready["tcp"], "STEPWATCH_SESSION_ID": session_id})
        assert rank.returncode == 0, rank.stdout + rank.stderr
        # the dashboard of the aggregator, its child process, reads the same ClickHouse store
        with urllib.request.urlopen(f"{ready['ui']}api/runs", timeout=30) as answer:
            runs = json.loads(answer.read())
        with urllib.request.urlopen(f"{ready['ui']}api/run/{session_id}", timeout=60) as answer:
            page = json.loads(answer.read())
    finally:
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    stopped = json.loads(out.splitlines()[-1])
    return {"base": base, "url": url, "session_id": session_id, "ready": ready, "stats": stopped["stats"],
            "stderr": err, "runs": runs, "page": page}


def test_the_aggregator_writes_every_row_to_clickhouse_and_no_history_sqlite(served: dict[str, Any]) -> None:
    assert served["ready"]["store"] == served["url"]
    assert not (served["base"] / "hub" / "history.sqlite").exists()
    stats = served["stats"]
    assert stats["rows_written"] > 0 and stats.get("write_errors", 0) == 0, stats
    live = stats["live_verdicts"]  # the verdicts thread read its windows back from ClickHouse
    assert live["evaluations"] > 0 and live["errors"] == 0, (live, served["stderr"])
    local = served["base"] / "local.sqlite"
    with SqliteStore(local) as sqlite:
        import_path(served["base"] / "rank0", sqlite)  # the rank's own artifacts
    store = open_store(served["url"], read_only=True)
    try:
        sid = served["session_id"]
        assert [s["session_id"] for s in store.sessions()] == [sid]
        with SqliteStore(local, read_only=True) as sqlite:
            for table in ("steps", "spans", "marks"):
                assert store.count(table, sid) == sqlite.count(table, sid) > 0, table
            keys = "SELECT rank, step, start_ns, end_ns FROM steps WHERE session_id = ? ORDER BY rank, step"
            assert store.query(keys, (sid,)) == sqlite.query(keys, (sid,))
        assert store.count("steps", sid) >= STEPS - 2
    finally:
        store.close()


def test_the_aggregators_dashboard_serves_the_clickhouse_history(served: dict[str, Any]) -> None:
    listed = [run for run in served["runs"]["runs"] if run["session_id"] == served["session_id"]]
    assert len(listed) == 1 and listed[0]["steps"] >= STEPS - 2, served["runs"]
    assert served["page"]["session"]["session_id"] == served["session_id"]
    (series,) = served["page"]["step_time"]["series"]
    assert series["rank"] == 0 and len(series["x"]) >= STEPS - 2


def test_summary_reads_the_served_history(served: dict[str, Any], tmp_path: Path) -> None:
    summary = run_stepwatch("summary", served["url"], "--json", cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    data = json.loads(summary.stdout)
    assert data["session_id"] == served["session_id"] and data["overall"]["steps"] >= STEPS - 2


def test_serve_refuses_a_store_path_and_a_server_that_refuses_it(clickhouse_server: Any, tmp_path: Path) -> None:
    """A server that answers "no" (an unknown user) fails the start; one that does not answer
    at all is waited for, spilling (tests/server/test_store_feed.py)."""
    path = run_stepwatch("serve", "--out", str(tmp_path / "o"), "--store", str(tmp_path / "h.sqlite"), cwd=tmp_path)
    assert path.returncode == 2 and "--store" in path.stderr
    refused = run_stepwatch("serve", "--out", str(tmp_path / "o"), "--store",
                            f"clickhouse://nobody@127.0.0.1:{clickhouse_server.tcp_port}/db", cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "cannot open history store" in refused.stderr, refused.stderr


PLAIN = f"""
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range({STEPS}):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
"""


def test_run_store_writes_the_history_to_clickhouse_and_summarises_from_it(clickhouse_server: Any,
                                                                           tmp_path: Path) -> None:
    url = clickhouse_server.database_url("run")
    (tmp_path / "train.py").write_text(PLAIN)
    ran = run_stepwatch("run", "--interval", "100", "--quiet", "--view", "off", "--store", url, "--report",
                        "--export", "tensorboard", "--out", str(tmp_path / "run"), str(tmp_path / "train.py"),
                        cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    run_dir = tmp_path / "run"
    assert not (run_dir / "history.sqlite").exists()
    # made from the store, of this run's session
    assert "report not written" not in ran.stderr and "failed" not in ran.stderr, ran.stderr
    manifest_id = json.loads((run_dir / "run.json").read_text())["session_id"]
    assert manifest_id in (run_dir / "report.html").read_text()
    assert list((run_dir / "tensorboard").glob(f"rank_0/events.out.tfevents.stepwatch-{manifest_id}"))
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["extra"]["store"] == url
    final = json.loads((run_dir / "final_summary.json").read_text())
    assert final["status"] == "completed" and final["overall"]["steps"] >= STEPS - 2
    read = run_stepwatch("summary", url, "--json", "--session", manifest["session_id"], cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    again = json.loads(read.stdout)
    # the same summary, but for what only the run directory knows (its run.json, its files)
    for key in ("exit_code", "outcome", "error", "errors", "aggregator", "unrecorded_tail"):
        final.pop(key, None)
        again.pop(key, None)
    assert again == final


def test_run_store_refuses_a_path(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("pass\n")
    path = run_stepwatch("run", "--store", str(tmp_path / "h.sqlite"), str(tmp_path / "train.py"), cwd=tmp_path)
    assert path.returncode == 2 and "--store" in path.stderr


def test_run_with_its_store_down_still_trains_and_summarises_from_its_artifacts(tmp_path: Path) -> None:
    """Fail open: the aggregator starts on a store that does not answer and spills every row to
    the run's store_spill.sqlite (said in one line at the end), the training runs, and its
    final summary comes from the ranks' own artifacts."""
    from tests.support import free_port

    (tmp_path / "train.py").write_text(PLAIN)
    down = f"clickhouse://default@127.0.0.1:{free_port()}/db"
    ran = run_stepwatch("run", "--interval", "100", "--quiet", "--view", "off", "--store", down,
                        "--out", str(tmp_path / "run"), str(tmp_path / "train.py"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert f"rows wait in {tmp_path / 'run' / 'store_spill.sqlite'}" in ran.stderr, ran.stderr
    spilled = sqlite3.connect(tmp_path / "run" / "store_spill.sqlite")
    try:
        assert spilled.execute("SELECT SUM(rows) FROM batches").fetchone()[0] > 0
    finally:
        spilled.close()
    final = json.loads((tmp_path / "run" / "final_summary.json").read_text())
    assert final["overall"]["steps"] >= STEPS - 2


def test_run_hands_the_store_url_to_its_aggregator_out_of_its_command_line(clickhouse_server: Any,
                                                                          tmp_path: Path) -> None:
    """A password in ``--store`` must not show in `ps`: the launcher passes the URL in the
    aggregator's environment, and the aggregator still writes there."""
    from stepwatch.server.launcher import LaunchOptions, _start_aggregator

    url = clickhouse_server.database_url("hidden")
    process, ready = _start_aggregator(tmp_path / "run", LaunchOptions(script=["train.py"], store=url))
    try:
        command = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "clickhouse://" not in command and "--store" not in command, command
        assert ready["store"] == url
    finally:
        process.terminate()
        process.wait(30)
        assert process.stdout is not None
        process.stdout.close()
