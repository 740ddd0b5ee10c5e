"""Commands that cannot do what they were asked say so (exit 2, one clear line) before they start
anything; commands that are asked to write, write. Real ``stepwatch`` subprocesses."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest

import stepwatch.ui
from tests.support import run_stepwatch
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

UI = Path(stepwatch.ui.__file__).resolve().parent  # the package under test, wherever it is imported from
TINY = "import sys\nprint('ran', sys.argv[1:])\n"


def nothing_started(cwd: Path) -> bool:
    return not (cwd / "stepwatch_runs").exists() and not (cwd / "out").exists()


@pytest.mark.parametrize("typo", [["--nproc-per-nod", "2"], ["--nproc-per-nod=2"]])
def test_run_with_a_mistyped_option_is_a_usage_error_that_starts_nothing(tmp_path: Path, typo: list[str]) -> None:
    (tmp_path / "train.py").write_text(TINY)
    proc = run_stepwatch("run", *typo, "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert "--nproc-per-nod" in proc.stderr and "Did you mean '--nproc-per-node'?" in proc.stderr
    assert "ran" not in proc.stdout and "aggregator" not in proc.stderr
    assert nothing_started(tmp_path)


def test_run_passes_options_after_the_script_to_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TINY)
    proc = run_stepwatch("run", "--quiet", "--out", "out", "train.py", "--nproc-per-nod", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran ['--nproc-per-nod', '2']" in proc.stdout
    assert json.loads((tmp_path / "out" / "run.json").read_text())["outcome"] == "succeeded"


def test_run_of_a_module_still_works(tmp_path: Path) -> None:
    (tmp_path / "tinymod.py").write_text(TINY)
    proc = run_stepwatch("run", "--quiet", "--out", "out", "-m", "tinymod", "x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran ['x']" in proc.stdout


def test_run_of_a_missing_script_starts_nothing(tmp_path: Path) -> None:
    proc = run_stepwatch("run", "missing.py", cwd=tmp_path)
    assert proc.returncode == 2, proc
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: missing.py: no such script (nothing was started)"], proc.stderr
    assert nothing_started(tmp_path)


def test_run_takes_its_own_python_named_before_the_script(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TINY)
    proc = run_stepwatch("run", "--quiet", "--out", "out", sys.executable, "train.py", "z", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran ['z']" in proc.stdout


def test_run_with_another_python_says_which_one_it_uses_and_starts_nothing(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / "python3"  # an interpreter of another environment
    other.parent.mkdir()
    other.symlink_to(sys.executable)
    (tmp_path / "train.py").write_text(TINY)
    proc = run_stepwatch("run", str(other), "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert str(Path(sys.executable).absolute()) in proc.stderr and "give the script alone" in proc.stderr
    assert "Traceback" not in proc.stderr and nothing_started(tmp_path)


@pytest.mark.parametrize("interpreter_options", [[], ["-X", "dev", "-u"]])
def test_track_of_a_missing_python_script_starts_nothing(tmp_path: Path, interpreter_options: list[str]) -> None:
    proc = run_stepwatch("track", "--", sys.executable, *interpreter_options, "missing.py", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert "missing.py: no such script" in proc.stderr and "Traceback" not in proc.stderr
    assert nothing_started(tmp_path)


def test_track_of_a_module_still_works(tmp_path: Path) -> None:
    (tmp_path / "tinymod.py").write_text(TINY)
    proc = run_stepwatch("track", "--out", "out", "--", sys.executable, "-m", "tinymod", "y", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ran ['y']" in proc.stdout


@pytest.fixture(scope="module")
def track_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once(tmp_path_factory, "ui-track-run", _track_run)


def _track_run(base: Path) -> Path:
    (base / "script.py").write_text(TINY)
    proc = run_stepwatch("track", "--interval", "100", "--out", "run", "--", sys.executable, "script.py", cwd=base)
    assert proc.returncode == 0, proc.stderr
    return base / "run"


def test_summary_of_an_unknown_session_is_an_error_listing_the_sessions(track_run: Path) -> None:
    sid = json.loads((track_run / "run.json").read_text())["session_id"]
    for target in (track_run, track_run / "telemetry" / "rank0"):
        proc = run_stepwatch("summary", str(target), "--session", "no-such-id", cwd=track_run.parent)
        assert proc.returncode == 2, proc
        assert "no-such-id" in proc.stderr and sid in proc.stderr and proc.stderr.startswith("error: ")
        assert proc.stdout == ""


def test_summary_write_on_a_track_run_writes_the_final_summary(track_run: Path, tmp_path: Path) -> None:
    track_run = Path(shutil.copytree(track_run, tmp_path / "run"))  # the shared run stays as it was
    assert not (track_run / "history.sqlite").exists()
    proc = run_stepwatch("summary", str(track_run), "--write", cwd=track_run.parent)
    assert proc.returncode == 0, proc.stderr
    written = json.loads((track_run / "final_summary.json").read_text())
    sid = json.loads((track_run / "run.json").read_text())["session_id"]
    assert written["session_id"] == sid and written["outcome"] == "succeeded"
    assert (track_run / "final_summary.txt").read_text() == proc.stdout


def _imports(path: Path) -> set[str]:
    """The ``stepwatch.ui`` modules ``path`` imports (any depth of the file, lazy ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [alias.name for alias in node.names]
            found.update(name.split(".")[0] for name in names)
    return {name for name in found if (UI / f"{name}.py").is_file()}


def test_the_cli_modules_import_no_cycle() -> None:
    graph = {path.stem: _imports(path) for path in UI.glob("*.py")}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or nxt not in seen and reaches(nxt, goal, seen | {nxt}) for nxt in graph.get(start, ()))

    cycles = [module for module in graph if reaches(module, module, set())]
    assert cycles == [], graph
    assert {"commands_capture", "commands_run"} <= graph["cli"]  # the group is assembled there
