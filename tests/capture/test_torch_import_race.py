"""The sampler thread ticking while the training thread is still inside ``import torch``.

``sys.modules["torch"]`` then holds the half-built module: no ``cuda``, ``optim`` or ``utils``
yet. A tick that touches them raises, which used to show as an internal error on every rank.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import stepwatch
from stepwatch.capture.api import current_runtime
from stepwatch.guard import reset_swallowed, swallowed


def test_tick_leaves_half_imported_torch_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Half-built from the start: a real torch imported by an earlier test (or at collection)
    # would otherwise be patched by init itself, before the tick under test.
    half_built = types.ModuleType("torch")  # what `import torch` has bound before its body ran
    monkeypatch.setitem(sys.modules, "torch", half_built)
    stepwatch.init(out=tmp_path / "run", interval=60.0)
    runtime = current_runtime()
    try:
        runtime.sampler.stopping.set()
        runtime.sampler.thread.join()
        reset_swallowed()
        runtime.devices.next_discovery = 0.0
        runtime.tick()
        assert swallowed() == {}
        assert runtime.patches is None and runtime.training.gpu_timer is None
    finally:
        monkeypatch.undo()
        stepwatch.shutdown()
