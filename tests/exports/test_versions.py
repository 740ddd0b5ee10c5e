"""The versions a run trained with, on the shared real two-rank ``stepwatch run``: its launcher
never imports torch (run.json has no torch version), so each rank records its own as it first
trains (``stepwatch.versions``), and the summary and the trackers' params read them there."""

from __future__ import annotations

import json
import platform
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import stepwatch
from stepwatch.analysis.program_settings import session_versions
from stepwatch.exports.tracker_data import tracker_params
from stepwatch.store.sqlite import SqliteStore

pytestmark = pytest.mark.real  # the run is a real stepwatch run (torchrun, two ranks)

torch = pytest.importorskip("torch")


def _marks(run: Path) -> list[tuple[int, str, dict[str, Any]]]:
    with sqlite3.connect(f"{(run / 'history.sqlite').as_uri()}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT rank, value_text, attrs FROM marks WHERE name = 'stepwatch.versions' "
                          "ORDER BY rank").fetchall()
    return [(rank, text, json.loads(attrs)) for rank, text, attrs in rows]


def test_each_rank_records_its_versions_once(run: Path) -> None:
    assert "torch" not in json.loads((run / "run.json").read_text())["versions"]  # the launcher's: no torch
    marks = _marks(run)
    assert [rank for rank, _, _ in marks] == [0, 1]  # once a rank
    for _, text, attrs in marks:
        assert text == torch.__version__
        assert attrs == {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                         "stepwatch": stepwatch.__version__, "platform": platform.platform()}


def test_the_summary_and_the_params_name_the_ranks_torch(run: Path) -> None:
    final = json.loads((run / "final_summary.json").read_text())
    assert final["versions"]["torch"] == torch.__version__ and final["versions"]["python"] == platform.python_version()
    text = (run / "final_summary.txt").read_text()
    assert f"versions torch {torch.__version__}" in text
    manifest = json.loads((run / "run.json").read_text())
    with SqliteStore(run / "history.sqlite", read_only=True) as store:
        params = tracker_params(store, manifest["session_id"], manifest)
        assert session_versions(store, "no-such-session") == {}
    assert params["version/torch"] == torch.__version__ and params["version/stepwatch"] == stepwatch.__version__
    assert ("version/cuda" in params) == (torch.version.cuda is not None)
