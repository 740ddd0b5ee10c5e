"""``<run>/alerts.jsonl``: the watchdog's alerts, one JSON object per line (docs/watchdog.md).

Fields: ``ts``, ``iso``, ``kind``, ``severity``, ``ranks`` (the culprit ranks only), ``step``,
``message``, ``evidence``, and ``session_id``. Appended by one writer (the aggregator, or
``stepwatch watch``), each line flushed as it is written, so a reader or a crash sees whole
lines only (a torn last line is skipped on reading).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError

__all__ = ["ALERTS_FILE", "AlertLog", "read_alerts"]

ALERTS_FILE = "alerts.jsonl"
_encoder = msgspec.json.Encoder()


class AlertLog:
    """Appends alert records to ``<run>/alerts.jsonl``; the file is opened per write, so a run
    directory that is moved or cleaned up under a long-lived server costs one failed write."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / ALERTS_FILE

    def append(self, record: Mapping[str, Any]) -> None:
        """Raises OSError when the line cannot be written."""
        line = _encoder.encode(record) + b"\n"
        with self.path.open("ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def read_alerts(path: str | os.PathLike[str], session_id: str | None = None) -> list[dict[str, Any]]:
    """The records of an alerts.jsonl (a file, or the run directory holding one), oldest first,
    of ``session_id`` if given; [] when there is none. A torn last line is skipped; any other
    bad line raises ArtifactError naming the file and line."""
    path = Path(path)
    if path.is_dir():
        path = path / ALERTS_FILE
    if not path.is_file():
        return []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    lines = data.split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = msgspec.json.decode(raw)
        except DECODE_FAILURES:
            if number == len(lines):
                break  # torn by a crash mid-write
            raise ArtifactError(path, "malformed JSON", line=number) from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str) \
                or not isinstance(record.get("ts"), (int, float)):
            raise ArtifactError(path, "an alert record must be an object with ts and kind", line=number)
        if session_id is not None and record.get("session_id") not in (None, session_id):
            continue
        records.append(record)
    return records
