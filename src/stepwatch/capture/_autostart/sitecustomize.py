"""Started by every Python process under ``stepwatch track`` or ``stepwatch run``: the first
Python process of each rank starts capture.

This directory is put first on PYTHONPATH by the launcher; after starting, it steps aside and
imports whatever ``sitecustomize`` the environment had, so nothing the user set up is lost.
"""

import os
import sys

# Programs that only start the ranks: under ``track`` they are not rank 0 themselves.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "deepspeed")


def _is_launcher() -> bool:
    argv = getattr(sys, "orig_argv", sys.argv)
    words = [os.path.basename(a) for a in argv[:3]]
    return any(w in _LAUNCHERS for w in words)


def _is_multiprocessing_child() -> bool:
    """A process multiprocessing started (spawn child, forkserver, resource tracker): it is not
    the rank's first process; it decides at its bootstrap whether it trains (children.py)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return "--multiprocessing-fork" in argv or any(a.startswith("from multiprocessing.") for a in argv)


def _holder_alive(path: str) -> bool:
    try:
        with open(path) as handle:
            pid = int(handle.read() or 0)
        os.kill(pid, 0)
    except (OSError, ValueError) as exc:
        return isinstance(exc, PermissionError)  # someone else's live process
    return True


def _claim(run_dir: str, session_id: str) -> str | None:
    """The claim file of this rank, or None when another live process already captures it.

    Only the first Python process of each rank captures: not the launcher's own Python, not
    DataLoader workers (they inherit the rank's environment while the rank is alive). A claim
    left by a dead process (a restarted worker, a reused --out) is taken over.
    """
    rank = os.environ.get("RANK") or os.environ.get("STEPWATCH_RANK")
    if rank is None and (os.environ.get("STEPWATCH_LAUNCHER") == "run" or _is_launcher()):
        return None
    path = os.path.join(run_dir, f".autostart-{session_id}-rank{rank or '0'}")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if _holder_alive(path):
                return None
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        except OSError:
            return None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return path
    return None


def _api(name: str) -> object:
    """``stepwatch.capture.api.<name>``, imported on the first call."""

    def call(*args: object) -> object:
        from stepwatch.capture import api

        return getattr(api, name)(*args)

    return call


def _autostart() -> None:
    run_dir = os.environ.get("STEPWATCH_RUN_DIR")
    if os.environ.get("STEPWATCH_AUTOSTART") != "1" or not run_dir:
        return
    try:
        import stepwatch  # first: an interpreter without stepwatch claims nothing, so track samples it from outside

        if _is_multiprocessing_child():
            from stepwatch.capture import children

            # the API is loaded only by a child that trains (a DataLoader worker never needs it)
            children.bind(_api("current_runtime"), _api("start_child"))
            install_bootstrap_hook = children.install_bootstrap_hook
            install_bootstrap_hook(spawned="--multiprocessing-fork" in getattr(sys, "orig_argv", sys.argv))
            return
        claim = _claim(run_dir, os.environ.get("STEPWATCH_SESSION_ID", "none"))
        if claim is not None and not stepwatch.init().active:
            os.unlink(claim)
    except Exception as exc:  # noqa: BLE001 - never stop the user's program from starting
        sys.stderr.write(f"[stepwatch] autostart failed, the program runs without capture: {exc}\n")


def _watch_launcher() -> None:
    """In torchrun's own process under ``stepwatch run``/``track``: when it ends on the
    ``ChildFailedError`` that names its failed workers, write them (rank, exit code or signal,
    pid, time) to ``<run>/torchrun_failures.json`` for the launcher, then let torchrun's own
    hook print what it prints. A rank killed by SIGKILL leaves no record of its own; this is
    the only place its signal is known (docs/run-outcome.md)."""
    run_dir = os.environ.get("STEPWATCH_RUN_DIR")
    if os.environ.get("STEPWATCH_AUTOSTART") != "1" or not run_dir or not _is_launcher():
        return
    previous = sys.excepthook

    def hook(typ, exc, tb):  # type: ignore[no-untyped-def]
        try:
            failures = getattr(exc, "failures", None)
            if isinstance(failures, dict):
                import json

                rows = [{"rank": int(rank), "local_rank": getattr(f, "local_rank", None),
                         "pid": getattr(f, "pid", None), "exitcode": int(getattr(f, "exitcode", 0)),
                         "at_ns": int(getattr(f, "timestamp", 0)) * 10**9 or None}
                        for rank, f in failures.items()]
                path = os.path.join(run_dir, "torchrun_failures.json")
                with open(path + ".tmp", "w") as handle:
                    json.dump({"session_id": os.environ.get("STEPWATCH_SESSION_ID"), "failures": rows}, handle)
                os.replace(path + ".tmp", path)
        except Exception:  # noqa: BLE001 - torchrun's own report must come out whatever happens here
            pass
        previous(typ, exc, tb)

    sys.excepthook = hook


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401 - the environment's own, if any
    except ImportError:
        sys.modules["sitecustomize"] = me  # the import machinery expects to find this module


_autostart()
_watch_launcher()
_chain()
