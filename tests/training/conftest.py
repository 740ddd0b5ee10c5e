"""Every training test starts with no runtime and no stray marks, and ends with torch unpatched
and nothing swallowed that the test did not expect (a test that expects it resets the guard)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import stepwatch
from stepwatch import guard
from stepwatch.capture import torch_patches, training


@pytest.fixture(autouse=True)
def _as_on_an_accelerator_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patches as a GPU host gets them (h2d copies intercepted), on this CPU-only torch; the
    tests of the CPU-only choice undo this."""
    monkeypatch.setattr(torch_patches, "_accelerator_present", lambda torch: True)


@pytest.fixture(autouse=True)
def _clean_runtime() -> Iterator[None]:
    guard.reset_swallowed()
    training.pre_init_marks()  # marks another test left for "the next runtime"
    yield
    stepwatch.shutdown()  # never leave torch patched behind a failed test
    assert guard.swallowed() == {}, guard.recent_swallowed()
