"""CUDA memory snapshots on request (docs/stacks.md, ``stepwatch memory-snapshot``): the rank
answers each new ``.MEMORY_SNAPSHOT`` once, at the sampler's tick, and keeps torch's allocator
history recording when asked to (``memory_history``), trying again as torch or CUDA come later.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..guard import guarded
from .controls import (
    MEMORY_SNAPSHOT_FILENAME,
    RequestFile,
    answer_memory_snapshot,
    memory_history_from_env,
    read_snapshot_request,
    record_memory_history,
)

__all__ = ["MemoryRequests"]

_RETRY_S = 5.0  # how often an allocator history not yet recording is tried again


class MemoryRequests:
    """One rank's memory snapshot requests. ``wanted``: record the allocator history (the
    ``memory_history`` option or ``STEPWATCH_MEMORY_HISTORY``); ``history``: it records."""

    def __init__(self, *, wanted: bool) -> None:
        self.wanted = wanted or memory_history_from_env()
        self.history = False
        self._next_try = 0.0
        self._file: RequestFile | None = None
        self._where: tuple[Path, str, int, str, int] | None = None  # run dir, name, rank, session, start
        self._answered: str | None = None
        if self.wanted:
            with guarded:
                self.history = record_memory_history()

    def watch(self, run_dir: Path, name: str, rank: int, session_id: str, started_ns: int) -> None:
        """Looks for ``.MEMORY_SNAPSHOT`` in ``run_dir`` from now on; ``name`` names the rank's files."""
        self._where = (run_dir, name, rank, session_id, started_ns)
        self._file = RequestFile(run_dir / MEMORY_SNAPSHOT_FILENAME)

    def poll(self, mono: float, say: Callable[..., None]) -> None:
        """Sampler: answers a new request once (``say`` writes the heartbeat record that tells how),
        and tries the allocator history again when it is wanted and not recording yet."""
        with guarded:
            self._answer(say)
        if self.wanted and not self.history and mono >= self._next_try:
            self._next_try = mono + _RETRY_S  # torch imported, or CUDA set up, later
            with guarded:
                self.history = record_memory_history()

    def _answer(self, say: Callable[..., None]) -> None:
        if self._file is None or self._where is None:
            return
        data = self._file.poll()
        if data is None:
            return
        run_dir, name, rank, session_id, started_ns = self._where
        request = read_snapshot_request(data, run_dir / MEMORY_SNAPSHOT_FILENAME, session_id, started_ns)
        if request is None or request.request_id == self._answered:
            return
        self._answered = request.request_id
        answer = answer_memory_snapshot(run_dir, name, rank, request, history=self.history)
        say("memory_snapshot", request_id=request.request_id, status=answer["status"], path=answer.get("path"),
            note=answer.get("note"))
