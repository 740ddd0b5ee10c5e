"""The in-process entry points: ``init``, ``shutdown``, ``progress``, ``oom_guard``.

``init`` either starts a ``Runtime`` or, if anything fails, installs a ``NullRuntime`` and logs
once: the user's program runs on either way. Invalid options are the one exception — they
raise ``ConfigError`` before anything is installed.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ..errors import ConfigError
from ..guard import Site, guarded, report_internal
from ..schema import SessionStatus
from . import children, phases, training
from .children import ChildProcess
from .config import RuntimeConfig
from .controls import Halt
from .runtime import NullRuntime, Runtime, is_oom

__all__ = ["Halt", "current_runtime", "halt_requested", "init", "oom_guard", "progress", "shutdown"]

_lock = threading.RLock()
_runtime: Runtime | NullRuntime = NullRuntime()
_previous_sigterm: Any = None
_closing_on_sigterm = False  # _on_sigterm is closing the session
_previous_excepthook: Callable[..., Any] | None = None
_previous_thread_hook: Callable[..., Any] | None = None
_atexit_registered = False


def current_runtime() -> Runtime | NullRuntime:
    return _runtime


def init(
    out: str | os.PathLike[str] | None = None,
    interval: float | None = None,
    *,
    enabled: bool = True,
    **options: Any,
) -> Runtime | NullRuntime:
    """Starts capture in this process (idempotent: a second call returns the running runtime).

    Args:
        out: run directory; default ``./stepwatch_runs/<UTC time>-<short session id>/``, or
            ``$STEPWATCH_RUN_DIR`` under ``stepwatch track``/``run``.
        interval: seconds between memory samples (default 1 s, or ``$STEPWATCH_INTERVAL_MS``
            under ``stepwatch track``/``run``; an explicit value wins).
        enabled: False installs nothing and writes nothing.
        **options: any other ``RuntimeConfig`` field (heartbeat_interval, table_rows, rank, ...).

    Raises:
        ConfigError: an option is invalid (nothing has been installed).
    """
    with _lock:
        if _runtime.active:
            return _runtime
        env = os.environ
        try:
            path = os.fspath(out) if out is not None else None
        except TypeError:
            raise ConfigError(f"out must be a path, got {type(out).__name__}") from None
        overrides = {"out": path, **options}
        if interval is not None:
            overrides["interval"] = interval
        config = RuntimeConfig.from_env(env, **overrides)  # raises ConfigError: nothing installed yet
        if not enabled:
            return _runtime
        try:
            runtime = Runtime(config, launched=env.get("STEPWATCH_LAUNCHER") is not None)
        except ConfigError as exc:
            if any(options.get(k) is not None for k in ("rank", "local_rank", "world_size")):
                raise  # the caller's own arguments are wrong
            # a launcher's environment that contradicts itself: the program must still run
            report_internal(exc, Site.INIT_IDENTITY)
            return _runtime
        except Exception as exc:  # noqa: BLE001 - start-up failed: run on without capture
            report_internal(exc, Site.INIT)
            return _runtime
        _activate(runtime, config)
        if config.auto_instrument:  # framework Trainers get their callback (integrations/autoattach.py)
            from .integrations import autoattach

            with guarded:
                autoattach.install()
        return runtime


def _activate(runtime: Runtime, config: RuntimeConfig) -> None:
    """The new runtime becomes the process's: the API, the scopes and the patches use it."""
    global _runtime
    _runtime = runtime
    phases.activate(runtime.scopes)
    training.activate(runtime.training)
    _install_hooks(config)


def start_child(config: RuntimeConfig, child: ChildProcess) -> Runtime | NullRuntime:
    """Starts capture in a process the training process started (see ``children.py``)."""
    with _lock:
        if _runtime.active:
            return _runtime
        try:
            runtime = Runtime(config, launched=True, child=child)
        except Exception as exc:  # noqa: BLE001 - the child runs on without capture
            report_internal(exc, Site.INIT_CHILD)
            return _runtime
        _activate(runtime, config)
        with guarded:
            # fork and forkserver children leave by os._exit after the target: no atexit there,
            # but multiprocessing runs its finalizers first (spawned children get both)
            import multiprocessing.util

            multiprocessing.util.Finalize(None, _at_exit, exitpriority=-100)
        return runtime




children.bind(current_runtime, start_child)  # children.py sits below this module

def shutdown(status: SessionStatus = "completed", timeout: float = 2.0) -> None:
    """Stops capture and closes the session (idempotent)."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, NullRuntime()
        phases.activate(None)
        training.activate(None)
    with guarded:
        runtime.stop(status, timeout)
    with guarded:
        _uninstall_hooks()
    autoattach = sys.modules.get("stepwatch.capture.integrations.autoattach")
    if autoattach is not None:
        with guarded:
            autoattach.uninstall()


def _uninstall_hooks() -> None:
    """Gives back the SIGTERM handler and excepthooks init installed (if nobody replaced them)."""
    global _previous_excepthook, _previous_thread_hook, _previous_sigterm
    if _previous_excepthook is not None and sys.excepthook is _excepthook:
        sys.excepthook = _previous_excepthook
        threading.excepthook = _previous_thread_hook or threading.__excepthook__
        _previous_excepthook = _previous_thread_hook = None
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm and _previous_sigterm is not None):
        signal.signal(signal.SIGTERM, _previous_sigterm)
        _previous_sigterm = None


def progress(step: int, **metrics: Any) -> None:
    """Reports training progress: a ``progress`` heartbeat record (loss, toks_per_s, ...)."""
    with guarded:
        _runtime.progress(step, **metrics)


def halt_requested() -> bool:
    """True once this rank has completed the step a ``stepwatch halt`` named: the loop may save a
    checkpoint and stop itself; if it goes on, the next step raises ``stepwatch.Halt``
    (docs/halt.md). Cheap enough to call every step (one attribute read)."""
    return _runtime.halt_step is not None


class oom_guard:  # noqa: N801 - reads as a statement: `with stepwatch.oom_guard():`
    """Records an out-of-memory error passing through (event + bundle), then lets it propagate."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is not None and is_oom(exc):
            _record_oom_once(exc)
        return False


def _record_oom_once(exc: BaseException) -> None:
    if getattr(exc, "__stepwatch_recorded__", False):
        return
    with guarded:
        try:
            exc.__stepwatch_recorded__ = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        _runtime.record_oom(exc)


# -- process hooks ----------------------------------------------------------------------------


def _install_hooks(config: RuntimeConfig) -> None:
    global _atexit_registered, _previous_excepthook, _previous_thread_hook, _previous_sigterm
    if not _atexit_registered:
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork)
        with guarded:
            children.install_bootstrap_hook()  # training processes it starts join the session
        _atexit_registered = True
    # Installed whether or not OOMs are captured: every uncaught exception is the run's outcome
    # (docs/run-outcome.md). Chained: the previous hook still prints the user's traceback.
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        _previous_thread_hook = threading.excepthook
        threading.excepthook = _thread_excepthook
    if config.handle_signals and threading.current_thread() is threading.main_thread():
        with guarded:
            current = signal.getsignal(signal.SIGTERM)
            if current is not _on_sigterm:
                _previous_sigterm = current
                signal.signal(signal.SIGTERM, _on_sigterm)


def _excepthook(typ: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if isinstance(_runtime, Runtime) and _runtime.config.capture_oom and is_oom(exc):
        _record_oom_once(exc)
    _record_failure(exc, tb, threading.current_thread().name, fatal=True)
    (_previous_excepthook or sys.__excepthook__)(typ, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        if isinstance(_runtime, Runtime) and _runtime.config.capture_oom and is_oom(args.exc_value):
            _record_oom_once(args.exc_value)
        thread = args.thread.name if args.thread is not None else "unknown thread"
        _record_failure(args.exc_value, args.exc_traceback, thread, fatal=False)
    (_previous_thread_hook or threading.__excepthook__)(args)


def _record_failure(exc: BaseException, tb: TracebackType | None, thread: str, *, fatal: bool) -> None:
    """The run's outcome hangs on this; it must neither raise nor print anything of its own
    (the user's hook prints the traceback, unchanged)."""
    runtime = _runtime
    if not isinstance(runtime, Runtime):
        return
    with guarded:
        runtime.record_failure(exc, tb, thread=thread, fatal=fatal)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Close the session cleanly, then end the process exactly as it would have ended.

    A second SIGTERM while the first closes the session is let go: the first ends the process
    once its files are written. Seconds are common: torchrun signals its ranks when it is
    stopped, and again (with the kernel's parent-death signal) when it dies; a rank that died of
    the second before writing run.json would leave its run reading ``running``."""
    global _closing_on_sigterm
    if _closing_on_sigterm:
        return
    _closing_on_sigterm = True
    previous = _previous_sigterm  # read first: shutdown gives the handler back
    if previous != signal.SIG_IGN and isinstance(_runtime, Runtime):
        with guarded:  # the default action ends the rank; a handler of the user's decides itself
            _runtime.record_signal(signum, fatal=not callable(previous))
    shutdown("completed")
    if callable(previous) or previous == signal.SIG_IGN:  # the process may go on (and init again)
        _closing_on_sigterm = False
        if callable(previous):
            previous(signum, frame)
    else:  # SIG_DFL: die by the signal so the parent sees the same exit status
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _at_exit() -> None:
    shutdown("completed")


def _after_fork() -> None:
    """A forked child must not write into its parent's files: it drops the runtime it inherited
    and its patches (which record into the inherited state). A multiprocessing child then starts
    its own capture if it trains (``children.py``); a DataLoader worker stays out."""
    global _runtime, _lock
    inherited, _runtime = _runtime, NullRuntime()
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork
    phases.activate(None)
    training.activate(None)
    children.forked_from(inherited)
    patches = getattr(inherited, "patches", None)
    if patches is not None:
        with guarded:
            patches._restore()  # noqa: SLF001 - not uninstall(): its lock may have been held at the fork


def run_dir() -> Path | None:
    return _runtime.run_dir
