"""Per-rank heartbeat files ``heartbeat_rank<N>.jsonl`` (spec: heartbeat-jsonl.md).

One JSON object per line with ``ts``, ``iso``, ``pid``, ``rank``, ``step``, ``msg`` always;
``gpu_mem_alloc``/``gpu_mem_reserved`` (MB) when CUDA is present; loss, toks_per_s, dt_fetch_s,
grad_norm on ``progress`` records. Written by the runtime's background thread only: the file
stays open and buffered, is flushed at least once a second, and rotates by size to
``heartbeat_rank<N>.jsonl.1`` (older files get higher numbers).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError
from ._files import cut_torn_tail

__all__ = ["HeartbeatWriter", "heartbeat_filename", "heartbeat_record", "json_safe", "read_heartbeat"]

_REQUIRED = ("ts", "rank", "step", "msg")
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def heartbeat_filename(rank: int) -> str:
    return f"heartbeat_rank{rank}.jsonl"


_JSON_LEAVES = frozenset({bool, int, float, type(None)})
_MAX_DEPTH = 8


def json_safe(value: Any, _depth: int = 0, *, finite: bool = False) -> Any:
    """``value`` as something ``msgspec.json`` always encodes, for values the user hands us
    (phase attributes, progress metrics): an encode failure in a writer would lose the record.

    Plain JSON values pass unchanged; numpy/torch scalars become their number (``.item()``);
    subclasses of bool/int/float/str become the base type; mappings and sequences are converted
    item by item (keys become strings); anything else, and text that is not valid UTF-8,
    becomes ``str()`` of it. ``finite``: NaN and infinities become "nan"/"inf"/"-inf" (span
    attrs, which the spool keeps strict JSON), else they pass as floats.
    """
    kind = type(value)
    if kind in _JSON_LEAVES:
        if finite and kind is float and not math.isfinite(value):
            return "nan" if value != value else ("inf" if value > 0 else "-inf")
        return value
    if kind is str:
        return value if value.isascii() else _utf8(value)
    if _depth >= _MAX_DEPTH:  # deep or self-referencing containers end as text
        return _text(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return json_safe(float(value), finite=finite)
    if isinstance(value, str):
        return _utf8(str.__str__(value))
    if isinstance(value, Mapping):
        return {(k if type(k) is str else _text(k)): json_safe(v, _depth + 1, finite=finite)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, _depth + 1, finite=finite) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            number = item()  # a numpy scalar or 0-d tensor (``loss=loss.detach()``): its number
        except Exception:  # noqa: BLE001 - not a scalar after all (an array): its text below
            pass
        else:
            if type(number) in _JSON_LEAVES:
                return json_safe(number, finite=finite)
    return _text(value)


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (os.fsdecode of bad bytes) cannot be written
        return text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def _text(value: Any) -> str:
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - a __str__ that raises still leaves a readable value
        return f"<unprintable {type(value).__name__}>"
    return _utf8(text) if type(text) is str else _text(text)


def heartbeat_record(
    *, ts: float, pid: int, rank: int, step: int, msg: str, **fields: Any
) -> dict[str, Any]:
    """A record in the spec's field order; None-valued extras are left out, numpy/torch scalars
    become numbers, other values JSON-safe (``json_safe``) and non-finite floats null, so every
    line stays strict JSON."""
    iso = datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    record: dict[str, Any] = {"ts": round(ts, 6), "iso": iso, "pid": pid, "rank": rank, "step": step, "msg": msg}
    for key, value in fields.items():
        if value is None:
            continue
        if type(value) not in _JSON_LEAVES:
            value = json_safe(value)
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        record[key] = value
    return record


class HeartbeatWriter:
    """Appends heartbeat records to one rank's file; not thread-safe (one background writer)."""

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, *, max_bytes: int = 16 * 1024 * 1024, keep: int = 3,
        name: str | None = None,
    ) -> None:
        # ``name`` (``rank<N>-p<pid>``): a second process recording the same rank keeps its own file
        self.path = Path(run_dir) / (f"heartbeat_{name}.jsonl" if name else heartbeat_filename(rank))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.keep = keep
        if self.path.exists():
            # a run resumed after a crash appends here: a line torn by the crash would otherwise
            # be glued to the first new record and make the whole file unreadable
            cut_torn_tail(self.path)
        self._file = self.path.open("ab", buffering=64 * 1024)
        self._size = self._file.tell()
        self._last_flush = time.monotonic()
        self.records_written = 0

    def write(self, record: Mapping[str, Any]) -> None:
        line = _encoder.encode(record) + b"\n"
        if self._size + len(line) > self.max_bytes and self._size > 0:
            self._rotate()
        self._file.write(line)
        self._size += len(line)
        self.records_written += 1

    def flush(self) -> None:
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.keep, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if index == self.keep:
                older.unlink(missing_ok=True)
            else:
                newer = older.with_name(f"{self.path.name}.{index + 1}")
                if older.exists():
                    os.replace(older, newer)
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("ab", buffering=64 * 1024)
        self._size = 0


def read_heartbeat(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of one heartbeat file, oldest first; unknown fields kept, a torn final line
    ignored. Raises ArtifactError naming the file, line and field for anything else."""
    return list(_iter_heartbeat(Path(path)))


def _iter_heartbeat(path: Path) -> Iterator[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = _decoder.decode(raw)
        except DECODE_FAILURES as exc:
            if number == len(lines) and not isinstance(exc, RecursionError):
                return  # torn by a crash mid-write (nesting is never a torn write)
            raise ArtifactError(path, f"malformed JSON: {undecodable(exc)}", line=number) from None
        if not isinstance(record, dict):
            raise ArtifactError(path, "a heartbeat record must be a JSON object", line=number)
        for key in _REQUIRED:
            if key not in record:
                raise ArtifactError(path, f"missing required field {key!r}", line=number, field=f"$.{key}")
        if type(record["ts"]) not in (int, float) or type(record["rank"]) is not int or type(record["step"]) is not int:
            raise ArtifactError(path, "ts must be a number, rank and step integers", line=number)
        yield record
