"""Capture from the first step: torch's patches go in the moment ``import torch`` completes,
before the program's next line, so a loop started right after the import is recorded whole
(capture/torch_attach.py, capture/after_import.py). Real subprocesses, a real torch loop."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stepwatch.artifacts.spool import read_spool
from stepwatch.capture import after_import
from tests.support import STEPWATCH, clean_env

PROGRAM = Path(__file__).resolve().parent / "programs" / "steps_after_import.py"
STEPS = 40


@pytest.mark.real
def test_a_loop_right_after_import_torch_is_recorded_whole_under_stepwatch_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([*STEPWATCH, "run", "--out", str(out), str(PROGRAM), str(STEPS)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with sqlite3.connect(out / "history.sqlite") as db:
        steps = [r[0] for r in db.execute("SELECT step FROM steps ORDER BY step")]
    assert steps == list(range(STEPS))


@pytest.mark.real
def test_a_loop_right_after_import_torch_is_recorded_whole_under_init(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(PROGRAM), str(STEPS), str(out)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spool = read_spool(out)
    indices = sorted(s["index"] for s in spool.spans if s["name"] == "step")
    assert indices == list(range(STEPS))


def test_the_callback_runs_before_the_importing_line_returns(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sw_probe_module.py").write_text(textwrap.dedent("""
        import sys
        body_done = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[bool] = []
    after_import.when_imported("sw_probe_module", lambda module: seen.append(module.body_done))
    assert "sw_probe_module" in after_import.waiting()
    assert any(isinstance(f, after_import.AfterImportFinder) for f in sys.meta_path)
    try:
        import sw_probe_module  # noqa: F401

        assert seen == [True]  # its body had run, and the import statement had not returned yet
    finally:
        sys.modules.pop("sw_probe_module", None)
    assert "sw_probe_module" not in after_import.waiting()
    if not after_import.waiting():  # nothing else waits: the finder has left the import path
        assert not any(isinstance(f, after_import.AfterImportFinder) for f in sys.meta_path)


def test_a_cancelled_wait_never_calls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sw_probe_cancelled.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[object] = []
    cancel = after_import.when_imported("sw_probe_cancelled", seen.append)
    cancel()
    try:
        import sw_probe_cancelled  # noqa: F401
    finally:
        sys.modules.pop("sw_probe_cancelled", None)
    assert seen == [] and "sw_probe_cancelled" not in after_import.waiting()


def test_a_failing_callback_leaves_the_import_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.guard import reset_swallowed, swallowed

    (tmp_path / "sw_probe_failing.py").write_text("x = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(module: object) -> None:
        raise RuntimeError("stepwatch bug")

    reset_swallowed()
    after_import.when_imported("sw_probe_failing", broken)
    try:
        import sw_probe_failing

        assert sw_probe_failing.x == 2
    finally:
        sys.modules.pop("sw_probe_failing", None)
    assert swallowed() == {"after_import.callback": 1}
    reset_swallowed()
