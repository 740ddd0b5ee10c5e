"""A run captured with ``track`` (no aggregator, no history): the catalog imports its artifacts
into a temporary store, the run page draws its steps, and nothing is written into the run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stepwatch.views.run_page import run_page
from stepwatch.views.sources import Catalog
from tests.support import run_stepwatch
from tests.support.web_runs import PROGRAM

pytestmark = pytest.mark.real



def test_a_track_run_without_history_is_drawn_from_its_artifacts(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    proc = run_stepwatch("track", "--interval", "200", "--out", str(run_dir), "--", sys.executable, str(PROGRAM),
                         "--steps", "30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    catalog = Catalog(run_dir)
    try:
        session = catalog.default_session()
        assert session is not None
        with catalog.open_session(session) as (store, found_dir):
            page = run_page(store, session, found_dir)
    finally:
        catalog.close()
    assert [(s["rank"], len(s["x"])) for s in page["step_time"]["series"]] == [(0, 30)]
    assert page["diagnosis"]["primary"] is not None and page["session"]["outcome"] == "succeeded"
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert not (run_dir / "history.sqlite").exists()
