"""The run the export tests read: the shared real two-rank ``stepwatch run`` of
tests/support/trace_run.py (made once per test session, read only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trace_run import trace_run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory (history.sqlite, run.json, the ranks' artifacts); torch is needed to make it."""
    pytest.importorskip("torch")
    return trace_run(tmp_path_factory)
