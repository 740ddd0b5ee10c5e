"""The suite's hypothesis profiles and fixtures every test folder may use; helpers to import live in
``tests/support``."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

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


def pytest_configure(config: pytest.Config) -> None:
    """``make test-fast`` (STEPWATCH_TESTS_FAST=1) starts no process: a test that tries is told
    to carry the ``real`` mark, so the fast loop stays fast as tests are added. Not in xdist's
    controller, which starts the workers."""
    controller = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if os.environ.get("STEPWATCH_TESTS_FAST") == "1" and not controller:
        subprocess.Popen._execute_child = _refuse  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = _refuse  # type: ignore[method-assign]


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("this test starts a process: mark it `real` (pytestmark = pytest.mark.real) or make it not")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each module's tests run on one xdist worker (``--dist loadgroup``), so a real run a
    module-scoped fixture makes is made once; a module may split itself with its own
    ``xdist_group`` marks. The modules with the most real runs go first, so the longest work
    starts first and the suite does not end waiting on one worker."""
    real: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        if item.get_closest_marker("real") is not None:
            real[module] = real.get(module, 0) + 1
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(module))
    order = {item.nodeid.split("::")[0]: i for i, item in reversed(list(enumerate(items)))}
    items.sort(key=lambda item: (-real.get(item.nodeid.split("::")[0], 0), order[item.nodeid.split("::")[0]]))
