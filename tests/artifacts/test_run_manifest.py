"""What ``run.json`` records of the machine, and that recording it starts no process."""

from __future__ import annotations

import platform
import subprocess
from typing import Any

import pytest

from stepwatch.artifacts.bundles import environment_info
from stepwatch.artifacts.run_manifest import current_versions, platform_text


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a process was started")


@pytest.mark.real  # platform.platform(), the text compared with, runs `uname -p`
def test_the_platform_is_platforms_own_text_read_without_starting_uname(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = platform.platform()
    monkeypatch.setattr(platform, "_uname_cache", None)  # as in a fresh process: nothing read yet
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)  # platform.processor() runs `uname -p`
    assert platform_text() == expected
    assert current_versions()["platform"] == expected
    assert environment_info()["platform"] == expected
