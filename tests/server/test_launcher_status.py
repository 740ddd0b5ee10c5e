"""The session's status a launcher's final summary writes (server/launcher.py
``write_final_summary``): on one node its own word is the last; on a node of a multi-node job
the session is shared, and the worst of every node's outcome stands, whichever launcher ends last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwatch.server.launcher import write_final_summary
from stepwatch.store.sqlite import SqliteStore

SID = "0f0e0d0c-0b0a-4908-8706-050403020100"


def _history(run_dir: Path, stored: str) -> None:
    """The history as the aggregators and the other node's launcher left it."""
    with SqliteStore(run_dir / "history.sqlite") as store:
        store.upsert_session({"session_id": SID, "status": "running", "started_at_ns": 1, "ended_at_ns": None,
                              "host": "node-b", "world_size": 4, "source": "stepwatch.tcp", "command_line": None})
        if stored != "running":
            store.upsert_session({"session_id": SID, "status": stored, "started_at_ns": None, "ended_at_ns": 5,
                                  "host": None, "world_size": None, "source": None, "command_line": None})


def _stored(run_dir: Path) -> str:
    with SqliteStore(run_dir / "history.sqlite", read_only=True) as store:
        return str(store.query("SELECT status FROM sessions WHERE session_id = ?", (SID,))[0]["status"])


@pytest.mark.parametrize(("stored", "mine", "across_nodes", "final"), [
    ("interrupted", "completed", True, "interrupted"),  # the other node's failure outlives this node's success
    ("completed", "interrupted", True, "interrupted"),
    ("running", "completed", True, "completed"),  # nothing stored yet but the open session: this node's
    ("interrupted", "completed", False, "completed"),  # one node: the launcher's final word
])
def test_the_final_status_is_the_worst_of_the_nodes(tmp_path: Path, stored: str, mine: str, across_nodes: bool,
                                                    final: str) -> None:
    _history(tmp_path, stored)
    summary = write_final_summary(tmp_path, SID, mine, 9, 4, ["train.py"], across_nodes=across_nodes)
    assert summary["status"] == final
    assert _stored(tmp_path) == final
    assert json.loads((tmp_path / "final_summary.json").read_text())["status"] == final
