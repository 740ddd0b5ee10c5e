"""A real run made once per test session, whichever parallel worker asks first.

pytest's module- and session-scoped fixtures are per process: under pytest-xdist a module whose
tests are spread over four workers trains its run four times. ``once`` builds the thing under a
file lock in the directory all workers share (the parent of each worker's base temp directory),
pickles what the builder returned beside it, and hands every later caller, in any worker, that
result. The runs it holds are read by the tests, never changed: a test that must change a run
copies it first.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every worker of this test session shares."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory: pytest.TempPathFactory, key: str, build: Callable[[Path], T]) -> T:
    """``build(directory)`` run once per session for ``key`` (an empty directory of its own), its
    result shared by every worker. A builder that raises leaves nothing behind: the next caller
    builds again (and, for a run that always fails, fails the same way)."""
    home = shared_dir(tmp_path_factory) / "shared-runs" / key
    home.mkdir(parents=True, exist_ok=True)
    done = home / "result.pickle"
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            result: T = pickle.loads(done.read_bytes())
            return result
        work = home / "work"
        if work.exists():  # a builder that raised before: start again from nothing
            work = home / f"work-{os.getpid()}"
        work.mkdir()
        result = build(work)
        done.write_bytes(pickle.dumps(result))
        return result
