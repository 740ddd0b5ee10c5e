"""CUDA memory snapshots on request: ``<run>/.MEMORY_SNAPSHOT`` and what the ranks answer.

``request_memory_snapshot`` writes the request (atomically); each rank's background thread
sees it at its next tick (about a second) and answers once per request: a rank that uses CUDA
writes ``torch.cuda.memory._dump_snapshot`` into ``<run>/memory_snapshots/<name>-<ts>.pickle``;
a CPU-only rank writes no file and answers that it has no CUDA. Every answer is a line of
``<run>/memory_snapshots/<name>.answers.jsonl`` (``read_memory_snapshot_answers``), and a
``memory_snapshot`` record in the rank's heartbeat (``docs/stacks.md``).

Nothing here imports torch: the request side runs in the aggregator and the CLI.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError
from ._files import atomic_write_bytes
from .live_ranks import live_ranks, require_run_dir

__all__ = [
    "MEMORY_SNAPSHOTS_DIR", "MEMORY_SNAPSHOT_FILENAME", "MemorySnapshotRequest", "parse_memory_snapshot_request",
    "read_memory_snapshot_answers", "request_memory_snapshot",
]

MEMORY_SNAPSHOT_FILENAME = ".MEMORY_SNAPSHOT"
MEMORY_SNAPSHOTS_DIR = "memory_snapshots"


class MemorySnapshotRequest(msgspec.Struct, kw_only=True, frozen=True):
    """The content of ``<run>/.MEMORY_SNAPSHOT``: each request has its own ``request_id`` (a
    rank answers each id once), the ``reason`` (e.g. the verdict that asked), and the session
    it is for (None: any)."""

    request_id: str
    reason: str
    requested_at: float
    session_id: str | None = None
    schema_version: int = 1


def request_memory_snapshot(run_dir: str | os.PathLike[str], *, reason: str,
                            session_id: str | None = None) -> MemorySnapshotRequest:
    """Asks every running rank of ``run_dir`` for a CUDA memory snapshot; returns at once (the
    ranks answer within about a second: ``read_memory_snapshot_answers``). Raises
    ``ArtifactError`` when ``run_dir`` is not a run directory or cannot be written."""
    root = require_run_dir(run_dir)
    if session_id is None:
        sessions = {r.session_id for r in live_ranks(root) if r.session_id}
        session_id = sessions.pop() if len(sessions) == 1 else None
    request = MemorySnapshotRequest(request_id=uuid.uuid4().hex, reason=str(reason)[:2000],
                                    requested_at=round(time.time(), 6), session_id=session_id)
    path = root / MEMORY_SNAPSHOT_FILENAME
    try:
        atomic_write_bytes(path, msgspec.json.encode(request), fsync=False)
    except OSError as exc:
        raise ArtifactError(path, f"cannot write: {exc.strerror or exc}") from exc
    return request


def parse_memory_snapshot_request(data: bytes, path: Path) -> MemorySnapshotRequest:
    try:
        return msgspec.json.decode(data, type=MemorySnapshotRequest)
    except msgspec.ValidationError as exc:
        raise ArtifactError(path, f"not a memory snapshot request: {exc}") from None
    except DECODE_FAILURES as exc:
        raise ArtifactError(path, f"not valid JSON: {exc}") from None


def read_memory_snapshot_answers(run_dir: str | os.PathLike[str], request_id: str | None = None) -> list[dict[str, Any]]:
    """The ranks' answers (all, or to ``request_id``), oldest first. Each has ``request_id``,
    ``rank``, ``name``, ``ts``, ``status`` (``written``, ``no_cuda``, ``failed``), and ``path``
    (relative to the run) when a snapshot was written, or a ``note``. Unreadable lines are skipped."""
    directory = Path(run_dir) / MEMORY_SNAPSHOTS_DIR
    answers: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.answers.jsonl")) if directory.is_dir() else []:
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                answer = msgspec.json.decode(line)
            except DECODE_FAILURES:
                continue
            if isinstance(answer, dict) and (request_id is None or answer.get("request_id") == request_id):
                answers.append(answer)
    return sorted(answers, key=lambda a: (a.get("ts") or 0, a.get("rank") or 0))
