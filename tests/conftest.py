"""The suite's hypothesis profiles and fixtures every test folder may use; helpers to import live in
``tests/support``."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

import stepwatch
from stepwatch import guard
from stepwatch.capture import torch_patches, training
from stepwatch.schema import new_session_id
from tests.support import EAGER_TORCH

# Property tests have no per-example deadline: speed is measured by bench/, never by a timed
# test, and a loaded machine is slower than this one. They draw new examples on every run
# (where bugs are found); HYPOTHESIS_PROFILE=ci draws the same examples each time (seeded from
# each test), so the gate CI keeps passes or fails on the code alone.
settings.register_profile("stepwatch", deadline=None)
settings.register_profile("ci", parent=settings.get_profile("stepwatch"), derandomize=True)
# the inner loop (make test-fast): a fifth of the examples, still new ones each run
settings.register_profile("fast", parent=settings.get_profile("stepwatch"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "stepwatch"))

# One intra-op thread in every process of the suite (its workers too, which import torch after
# this), as torchrun gives each rank: four workers share two cores, and torch's OpenMP threads
# spin between operations (10 % of the CPU of the Trainer tests). A value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Every process the suite starts (its workers too) has this folder first on PYTHONPATH, where a
# sitecustomize keeps torch from importing its compiler into programs that never compile: 1.3 s
# of CPU in each of the suite's ~150 training processes (the module says how; test_eager_torch.py
# checks it changes no result).
if EAGER_TORCH not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [EAGER_TORCH, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session", autouse=True)
def _page_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The dashboard keeps finished runs' pages in a cache folder of the user's
    (stepwatch.views.page_cache): the suite's go to a folder of its own, which the processes it
    starts inherit (tests.support.clean_env keeps the variable)."""
    before = os.environ.get("STEPWATCH_CACHE_DIR")
    os.environ["STEPWATCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("page-cache"))
    yield
    if before is None:
        os.environ.pop("STEPWATCH_CACHE_DIR", None)
    else:
        os.environ["STEPWATCH_CACHE_DIR"] = before


@pytest.fixture
def session_id() -> str:
    return new_session_id()


@pytest.fixture
def training_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that trains in this process (``pytest.mark.usefixtures("training_test")``): it starts
    with no runtime and no stray marks, sees the torch patches as a GPU host gets them (h2d copies
    intercepted, on this CPU-only torch; the tests of the CPU-only choice undo this), and ends with
    torch unpatched and nothing swallowed that it did not expect (a test that expects it resets
    the guard)."""
    monkeypatch.setattr(torch_patches, "_accelerator_present", lambda torch: True)
    guard.reset_swallowed()
    training.pre_init_marks()  # marks another test left for "the next runtime"
    yield
    stepwatch.shutdown()  # never leave torch patched behind a failed test
    assert guard.swallowed() == {}, guard.recent_swallowed()


_FAST = os.environ.get("STEPWATCH_TESTS_FAST") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """``make test-fast`` (STEPWATCH_TESTS_FAST=1) starts no process: a test (or a fixture of
    it) that tries is told to carry the ``real`` mark, so the fast loop stays fast as tests are
    added. Only while a test runs: pytest and xdist start processes of their own."""
    if not _FAST:
        yield
        return
    saved = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start
    subprocess.Popen._execute_child = _refuse  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = saved  # type: ignore[method-assign]


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("this test starts a process: mark it `real` (pytestmark = pytest.mark.real) or make it not")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules with the most real runs go first: xdist hands tests out in this order, so the
    longest work starts first and the suite does not end waiting on one worker."""
    real: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        first.setdefault(module, index)
        if item.get_closest_marker("real") is not None:
            real[module] = real.get(module, 0) + 1
    items.sort(key=lambda item: (-real.get(module := item.nodeid.split("::")[0], 0), first[module]))


@pytest.fixture(scope="session")
def clickhouse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Debian's clickhouse-server on 127.0.0.1, one for the whole test session and every worker
    (tests/support/clickhouse.py); each test takes a database of its own with ``database_url()``.
    Skips where the server is not installed, unless STEPWATCH_REQUIRE_CLICKHOUSE=1."""
    from tests.support.clickhouse import clickhouse_server as serve

    yield from serve(tmp_path_factory)
