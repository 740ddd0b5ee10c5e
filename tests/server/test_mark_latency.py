"""Spans and marks reach the aggregator's history at the tick cadence, not only at spool seals."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

RANK = """
import sys, time, stepwatch
stepwatch.init(out=sys.argv[1], aggregator=sys.argv[2], interval=0.2, spool_interval=60.0)
with stepwatch.scope("work"):
    stepwatch.mark("loss", 0.5)
print("MARKED", flush=True)
time.sleep(30)
"""


def _count(db: Path, sql: str) -> int:
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return conn.execute(sql).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def test_marks_and_spans_reach_the_history_long_before_the_spool_seals(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "RANK", "WORLD_SIZE"))}
    serve = subprocess.Popen([sys.executable, "-m", "stepwatch.server", "--out", str(tmp_path / "hub"), "--port", "0"],
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    rank = None
    try:
        assert serve.stdout is not None
        address = json.loads(serve.stdout.readline())["tcp"]
        rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK), str(tmp_path / "run"), address],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert rank.stdout is not None and rank.stdout.readline().strip() == "MARKED"
        marked = time.monotonic()
        db = tmp_path / "hub" / "history.sqlite"
        while time.monotonic() - marked < 10 and not (
                _count(db, "SELECT COUNT(*) FROM marks WHERE name = 'loss'")
                and _count(db, "SELECT COUNT(*) FROM spans WHERE name = 'work'")):
            time.sleep(0.1)
        waited = time.monotonic() - marked
        assert waited < 4.0, f"mark and span not in the history after {waited:.1f} s (spool seals every 60 s)"
        assert not list((tmp_path / "run" / "spool").glob("*.json"))  # no seal has happened yet
    finally:
        if rank is not None:
            rank.kill()
            rank.communicate()
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)
