"""Started by every Python process under ``stepwatch track``: the first one starts capture.

This directory is put first on PYTHONPATH by the launcher; after starting, it steps aside and
imports whatever ``sitecustomize`` the environment had, so nothing the user set up is lost.
"""

import os
import sys


def _claim(run_dir: str) -> bool:
    # Only the first Python process of each rank captures (not the launcher's own Python, not
    # spawned DataLoader workers, which inherit the rank's environment).
    if os.environ.get("STEPWATCH_LAUNCHER") == "run" and not (os.environ.get("RANK") or os.environ.get("STEPWATCH_RANK")):
        return False  # the torchrun agent itself, not a rank
    rank = os.environ.get("RANK") or os.environ.get("STEPWATCH_RANK") or "0"
    try:
        fd = os.open(os.path.join(run_dir, f".autostart-rank{rank}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _autostart() -> None:
    run_dir = os.environ.get("STEPWATCH_RUN_DIR")
    if os.environ.get("STEPWATCH_AUTOSTART") != "1" or not run_dir:
        return
    try:
        if _claim(run_dir):
            import stepwatch

            stepwatch.init()
    except Exception as exc:  # noqa: BLE001 - never stop the user's program from starting
        sys.stderr.write(f"[stepwatch] autostart failed, the program runs without capture: {exc}\n")


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401 - the environment's own, if any
    except ImportError:
        sys.modules["sitecustomize"] = me  # the import machinery expects to find this module


_autostart()
_chain()
