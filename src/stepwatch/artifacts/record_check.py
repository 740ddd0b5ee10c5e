"""``stepwatch validate``: check every record of an artifact and report each problem where it is.

Unlike the loaders, which stop at the first bad record, this visits them all, so one run
lists every invalid line of every file. Beyond records it reports, as errors, what the loaders
count and skip: a segment the manifest lists but that is missing, an unreadable manifest, an
empty file given directly; and as a warning a segment the manifest says held data but that is
empty (an empty segment nothing was flushed to yet is normal).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES, undecodable
from ..errors import ArtifactError, ValidationError
from ..schema import telemetry_event_from_record, validate_telemetry_record
from .manifest import MANIFEST_FILENAME, SEGMENT_PREFIX, SEGMENT_SUFFIX, read_manifest
from .telemetry_loader import events_key_problem, find_sink_dirs

__all__ = ["CheckReport", "Problem", "check_artifact"]

_any = msgspec.json.Decoder()


class Problem(msgspec.Struct, kw_only=True):
    """One invalid record (or file): where it is and what is wrong."""

    file: str
    line: int | None = None
    index: int | None = None
    field: str | None = None
    reason: str
    severity: str = "error"


class CheckReport(msgspec.Struct, kw_only=True):
    files: int = 0
    records: int = 0
    valid: int = 0
    problems: list[Problem] = msgspec.field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]


def check_artifact(path: str | os.PathLike[str], permissive_legacy: bool = False) -> CheckReport:
    """Validates every record under ``path`` (run dir, sink dir, manifest, segment or JSON export).

    Records must carry a supported ``schema_version`` unless ``permissive_legacy`` lets legacy
    records through conversion.
    """
    root = Path(path)
    report = CheckReport()
    if not root.exists():
        report.problems.append(Problem(file=str(root), reason="no such file or directory"))
        return report
    given_file = root.is_file()
    for file in _files(root, report):
        report.files += 1
        if file.name == MANIFEST_FILENAME:
            _check_manifest(file, report)
            continue
        if given_file and _is_empty(file):
            report.problems.append(Problem(file=str(file), reason="file is empty"))
            continue
        for line, index, record, error in _records(file):
            report.records += 1
            if error is not None:
                severity = "warning" if error.startswith("torn") else "error"
                field = error.split(" ", 1)[0] if error.startswith("$.") else None
                report.problems.append(
                    Problem(file=str(file), line=line, index=index, field=field, reason=error, severity=severity)
                )
                continue
            try:
                if permissive_legacy:
                    telemetry_event_from_record(record)
                else:
                    validate_telemetry_record(record)
            except ValidationError as exc:
                report.problems.append(
                    Problem(file=str(file), line=line, index=index, field=exc.field, reason=exc.rule)
                )
                continue
            report.valid += 1
    return report


def _check_manifest(file: Path, report: CheckReport) -> None:
    """The manifest reads, and every segment it lists is there (pruned ones are not listed)."""
    try:
        manifest = read_manifest(file)
    except ArtifactError as exc:
        report.problems.append(Problem(file=str(file), field=exc.field, reason=exc.reason))
        return
    for entry in manifest.segments:
        segment = file.parent / entry.filename
        if not segment.exists():
            report.problems.append(Problem(
                file=str(segment), reason=f"listed in {MANIFEST_FILENAME} but missing on disk",
            ))
        elif entry.size_bytes and _is_empty(segment):
            report.problems.append(Problem(
                file=str(segment), severity="warning",
                reason=f"file is empty although {MANIFEST_FILENAME} recorded {entry.size_bytes} bytes",
            ))


def _is_empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False  # the read names the problem


def _files(root: Path, report: CheckReport) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    sinks = find_sink_dirs(root)
    if not sinks:
        report.problems.append(Problem(file=str(root), reason="no telemetry artifacts found"))
    for sink in sinks:
        if (sink / MANIFEST_FILENAME).is_file():
            yield sink / MANIFEST_FILENAME
        yield from sorted(sink.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))


def _records(file: Path) -> Iterator[tuple[int | None, int | None, Any, str | None]]:
    """(line, index, decoded record or None, error or None) for each record of a file."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        yield None, None, None, f"cannot read: {exc.strerror}"
        return
    if file.suffix == ".jsonl":
        lines = data.split(b"\n")
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                yield number, None, _any.decode(raw), None
            except DECODE_FAILURES as exc:  # not UTF-8, nested too deeply: not DecodeErrors
                # no newline after it: a write torn by a crash (nesting is never a torn write)
                last = number == len(lines) and not isinstance(exc, RecursionError)
                yield number, None, None, ("torn final line (ignored by loaders)" if last
                                           else f"malformed JSON: {undecodable(exc)}")
        return
    if not data.strip():
        yield None, None, None, "file is empty"
        return
    try:
        payload = _any.decode(data)
    except DECODE_FAILURES as exc:
        yield None, None, None, f"not valid JSON: {undecodable(exc)}"
        return
    if isinstance(payload, dict):
        for key in ("events", "telemetry_events"):
            if isinstance(payload.get(key), list):
                payload = payload[key]
                break
        else:
            for key in ("events", "telemetry_events"):
                if key in payload:  # as the loaders say: not one record with an odd field
                    yield None, None, None, events_key_problem(key, payload[key])
                    return
            payload = [payload]
    if not isinstance(payload, list):
        yield None, None, None, f"expected a JSON array or object, got {type(payload).__name__}"
        return
    for index, record in enumerate(payload):
        yield None, index, record, None
