"""The suite's hypothesis profiles and fixtures every test folder may use; helpers to import live in
``tests/support``."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from stepwatch.schema import new_session_id

# Property tests have no per-example deadline: speed is measured by bench/, never by a timed
# test, and a loaded machine is slower than this one. They draw new examples on every run
# (where bugs are found); HYPOTHESIS_PROFILE=ci draws the same examples each time (seeded from
# each test), so the gate CI keeps passes or fails on the code alone.
settings.register_profile("stepwatch", deadline=None)
settings.register_profile("ci", parent=settings.get_profile("stepwatch"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "stepwatch"))


@pytest.fixture
def session_id() -> str:
    return new_session_id()
