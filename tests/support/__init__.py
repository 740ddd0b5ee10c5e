"""Helpers every test that starts a real process shares: the ``stepwatch`` command, an environment
free of the caller's stepwatch/torchrun contract, and a free loopback port.

Tests run in parallel (pytest-xdist), so nothing here holds a fixed port or a shared path.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the folder tests/conftest.py puts first on PYTHONPATH (its sitecustomize says why)
EAGER_TORCH = str(Path(__file__).resolve().parent / "eager_torch")


def examples(n: int) -> int:
    """``n`` property-test examples; under the inner loop's profile (``HYPOTHESIS_PROFILE=fast``,
    ``make test-fast``) a fifth of them, at least 10, as that profile gives a test that names no
    count (an explicit ``max_examples`` overrides any profile)."""
    return max(10, n // 5) if os.environ.get("HYPOTHESIS_PROFILE") == "fast" else n


_script = shutil.which("stepwatch", path=str(Path(sys.executable).parent))
STEPWATCH = [_script] if _script else [sys.executable, "-m", "stepwatch.ui.cli"]

# what a test's own environment may carry that would change what a started process does: the
# stepwatch and torchrun contracts, a rich console's forced settings, the Cirron SDK's settings
_LEAKS = ("STEPWATCH_", "CIRRON_", "FORCE_COLOR", "COLUMNS", "TTY_COMPATIBLE", "RANK", "LOCAL_RANK", "WORLD_SIZE",
          "MASTER_", "TORCHELASTIC_")
# ... but the suite's own page cache folder (tests/conftest.py) goes to every process it starts
_KEPT = ("STEPWATCH_CACHE_DIR",)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any variable that would change a started process's
    identity or output, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _KEPT or not k.startswith(_LEAKS)}
    env.update(extra)
    return env


def needs(library: str) -> Any:
    """A mark that skips the module's tests where ``library`` is not installed, without importing
    it: every pytest-xdist worker collects every test module, and a module-level
    ``pytest.importorskip("mlflow")`` costs each worker 1.7 s of CPU (the tests import it)."""
    import importlib.util

    import pytest

    return pytest.mark.skipif(importlib.util.find_spec(library) is None, reason=f"{library} is not installed")


def free_port() -> int:
    """A loopback port free right now (the kernel's pick, so parallel tests do not collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The commands that read a run and print, starting nothing and changing nothing that outlives them:
# ``run_stepwatch`` runs these in this process (click's CliRunner, with the environment and working
# directory the subprocess would have), which saves the 0.2 s of CPU a new interpreter costs, some
# 70 times a suite. tests/ui/test_cli.py runs each of them as the real console script too.
IN_PROCESS = frozenset({"summary", "query", "explain", "compare", "inspect", "sessions", "validate", "report"})


def run_stepwatch(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """``stepwatch ARGS`` run to its end in ``cwd`` with a clean environment, output captured."""
    if args and args[0] in IN_PROCESS:
        return _invoke(args, cwd, env)
    return subprocess.run([*STEPWATCH, *args], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _invoke(args: tuple[str, ...], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command in this process, answered as the subprocess would: what escapes it is a
    traceback on stderr and exit code 1."""
    from click.testing import CliRunner

    from stepwatch.ui.cli import cli

    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith(_LEAKS) and k not in _KEPT}
    before = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, list(args), env={**unset, **env}, prog_name="stepwatch")
    finally:
        os.chdir(before)
    code, stderr = result.exit_code, result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        code, stderr = 1, stderr + "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess([*STEPWATCH, *args], code, result.stdout, stderr)
