"""Phase scopes: ``with stepwatch.phase("train", epoch=3):`` and ``@stepwatch.phase("eval")``.

The calling thread only reads two clocks and appends one tuple to a bounded table; the
``phase_enter``/``phase_exit`` records with their ``phase_scope`` payload (spec: "Structured
phase metadata") are built later on the background thread. Scopes nest per thread and per
asyncio task.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from ..guard import Site, report_internal

__all__ = ["PhaseRow", "PhaseScopes", "activate", "phase"]

F = TypeVar("F", bound=Callable[..., Any])


class PhaseRow(NamedTuple):
    """One boundary as the background thread reads it. The calling thread appends a plain tuple
    in this field order (a NamedTuple costs a Python-level ``__new__`` per row); scope ids are
    sequence numbers there, formatted as ``<session>:<n>`` only when the record is built."""

    action: str  # "enter" | "exit"
    timestamp_ns: int
    name: str
    path: tuple[str, ...]
    scope_seq: int
    parent_seq: int | None
    thread_id: int
    thread_name: str
    sequence: int
    attributes: dict[str, Any] | None


class PhaseScopes:
    """Per-runtime scope state: sequence numbers and each thread's (each task's) open scopes."""

    def __init__(self, session_id: str, append: Callable[[tuple[Any, ...]], None]) -> None:
        self.prefix = f"{session_id}:"
        self._append = append
        self._sequence = itertools.count(1)  # next() is atomic under the GIL
        self._threads = threading.local()  # (ident, name) of the thread, looked up once
        # The open scopes live in a ContextVar, not a threading.local: asyncio tasks sharing one
        # thread each keep their own stack (a task never nests under, or closes, another task's
        # scope), and a new thread starts with an empty one.
        # A stack entry is (name, path, seq, attributes).
        self._open: contextvars.ContextVar[tuple[tuple[Any, ...], ...]] = contextvars.ContextVar(
            "stepwatch_phase_scopes", default=()
        )

    def scope_id(self, seq: int | None) -> str | None:
        return None if seq is None else f"{self.prefix}{seq}"

    def _thread(self) -> tuple[int, str]:
        info = getattr(self._threads, "info", None)
        if info is None:
            thread = threading.current_thread()
            info = self._threads.info = (thread.ident or 0, thread.name)
        return info

    def current_path(self) -> tuple[str, ...]:
        stack = self._open.get()
        return stack[-1][1] if stack else ()

    def enter(self, name: str, attributes: dict[str, Any] | None) -> None:
        stack = self._open.get()
        sequence = next(self._sequence)
        if stack:
            parent = stack[-1]
            path, parent_seq = (*parent[1], name), parent[2]
        else:
            path, parent_seq = (name,), None
        self._open.set((*stack, (name, path, sequence, attributes)))
        ident, thread_name = self._thread()
        self._append(("enter", time.time_ns(), name, path, sequence, parent_seq, ident, thread_name,
                      sequence, attributes))

    def exit(self) -> None:
        stack = self._open.get()
        if not stack:
            return
        name, path, seq, attributes = stack[-1]
        rest = stack[:-1]
        self._open.set(rest)
        ident, thread_name = self._thread()
        self._append(("exit", time.time_ns(), name, path, seq, rest[-1][2] if rest else None, ident,
                      thread_name, next(self._sequence), attributes))


_active: PhaseScopes | None = None  # the running runtime's scopes; None when stepwatch is off


def activate(scopes: PhaseScopes | None) -> None:
    """Points ``phase`` at a runtime's scopes (None turns phases into no-ops)."""
    global _active
    _active = scopes


class phase:  # noqa: N801 - used like a function: `with stepwatch.phase(...)`, `@stepwatch.phase(...)`
    """Marks a workload phase; a context manager and a decorator (async functions included).

    Example::

        with stepwatch.phase("train", epoch=3):
            ...

        @stepwatch.phase("evaluate")
        def evaluate(model): ...

    Holds no per-use state, so one instance may be entered from many threads. User exceptions
    pass through unchanged; stepwatch's own errors are swallowed (fail-open).
    """

    __slots__ = ("name", "attributes")

    def __init__(self, name: str, **attributes: Any) -> None:
        self.name = str(name)
        self.attributes = attributes or None

    def __enter__(self) -> phase:
        scopes = _active
        if scopes is not None:
            try:
                scopes.enter(self.name, self.attributes)
            except Exception as exc:  # noqa: BLE001 - fail-open
                report_internal(exc, Site.PHASE_ENTER)
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        scopes = _active
        if scopes is not None:
            try:
                scopes.exit()
            except Exception as error:  # noqa: BLE001 - fail-open
                report_internal(error, Site.PHASE_EXIT)
        return False

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with phase(self.name, **(self.attributes or {})):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(self.name, **(self.attributes or {})):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
