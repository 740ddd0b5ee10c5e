"""A full disk under ``stepwatch run`` and ``stepwatch track``: a real 600 kB tmpfs as the run
directory and a 3,000-step loop. The training's exit code, one line saying what was lost, the
summary printed even though it cannot be written, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import STEPWATCH, clean_env

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

LOOP = """
import torch
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
for epoch in range(3):
    for i in range(1000):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 600 kB tmpfs, mounted for the test (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    done = subprocess.run(check=False, args=["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(check=False, args=["umount", "-l", str(mount)], capture_output=True)


def _no_traceback(output: str) -> None:
    assert "Traceback" not in output, output
    assert "Errno 28" not in output.replace("OSError: [Errno 28] No space left on device", ""), output


def test_run_on_a_full_disk_ends_with_the_trainings_code_one_line_and_the_summary(tiny_disk: Path, tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tiny_disk / "run"
    proc = subprocess.run(check=False, args=[*STEPWATCH, "run", "--out", str(out), str(script)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output  # the training's exit code, not the launcher's trouble
    _no_traceback(output)
    disk_lines = [line for line in proc.stderr.splitlines() if "is full" in line]
    assert len(disk_lines) == 1, proc.stderr  # one line, with counts
    assert "rows did not reach history.sqlite" in disk_lines[0] and "failed writes" in disk_lines[0]
    assert "a write failed, its rows are lost" not in proc.stderr
    # the summary is printed though it could not be written, and says what the history lost
    assert "stepwatch summary  session" in proc.stdout
    assert "history:" in proc.stdout and "rows lost (the disk was full" in proc.stdout
    assert "exit code 0" in proc.stdout


def test_track_on_a_full_disk_ends_with_the_trainings_code(tiny_disk: Path, tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = tiny_disk / "run"
    proc = subprocess.run(check=False, args=[*STEPWATCH, "track", "--out", str(out), "--", sys.executable, str(script)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    _no_traceback(output)
    assert "exit code 0" in proc.stderr
