"""A run captured with ``track`` (no aggregator, no history): the catalog imports its artifacts
into a temporary store, the run page draws its steps, and nothing is written into the run."""

from __future__ import annotations

import pytest

from stepwatch.views.run_page import run_page
from stepwatch.views.sources import Catalog
from tests.support.web_runs import TRACK_STEPS, track_run

pytestmark = pytest.mark.real



def test_a_track_run_without_history_is_drawn_from_its_artifacts(tmp_path_factory: pytest.TempPathFactory) -> None:
    run_dir = track_run(tmp_path_factory)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    catalog = Catalog(run_dir)
    try:
        session = catalog.default_session()
        assert session is not None
        with catalog.open_session(session) as (store, found_dir):
            page = run_page(store, session, found_dir)
    finally:
        catalog.close()
    assert [(s["rank"], len(s["x"])) for s in page["step_time"]["series"]] == [(0, TRACK_STEPS)]
    assert page["diagnosis"]["primary"] is not None and page["session"]["outcome"] == "succeeded"
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert not (run_dir / "history.sqlite").exists()
