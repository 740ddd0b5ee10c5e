"""The running stepwatch the integration tests train under."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import stepwatch
from stepwatch.capture import api
from stepwatch.guard import reset_swallowed, swallowed

QUIET = {"handle_signals": False, "capture_oom": False}


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A running stepwatch writing to ``tmp_path/run``; swallowed internal errors fail the test."""
    assert not api.current_runtime().active
    reset_swallowed()
    out = tmp_path / "run"
    stepwatch.init(out=out, **QUIET)
    try:
        yield out
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
