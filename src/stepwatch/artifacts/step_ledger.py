"""The step ledger: each rank's closed steps in a small memory-mapped file that outlives the rank.

A rank's steps reach the spool at each seal (every 2 s) and the aggregator at each tick (about
once a second); a rank killed by SIGKILL lost the steps closed since. The ledger closes that
window: the training thread copies each closed step's times into a ``MAP_SHARED`` mapping of
``<run>/ledger/rank<R>-<pid>.steps`` (one ``struct.pack_into``, no system call), and the kernel
keeps those pages when the process dies, whatever killed it. After the run, the launcher and
``stepwatch import`` read the ledgers and add the steps the history lacks.

The file (little-endian, sizes fixed by the header; ``docs/crash-safety.md``)::

    header (128 bytes): magic "SWLEDGR1", version u32, record_size u32, capacity u32, rank i32,
        pid i32, started_ns i64, alive_ns i64 (the sampler's last sign of life), closed_ns i64
        (0 until the rank stopped cleanly), session_id (40 bytes, ASCII, NUL-padded)
    capacity records (88 bytes each in version 2), a ring: record n (from 1) lives in slot
        (n - 1) % capacity: seq u64, step index i64, start_ns i64, end_ns i64, one i64 per phase
        in the order of stepwatch.phases (data_load, h2d, forward, backward, optimizer_step,
        recompute), seq u64 again. Version 1 had the first five phases (80 bytes); it reads too.

The sequence number is written first and last (``pack_into`` writes in field order), so a record
the kill cut in half reads as two different numbers and is skipped, never half-believed. The
file is allocated in full when it is created (``posix_fallocate``): a page first touched on a
full disk would kill the process with SIGBUS, so on a disk without room there is no ledger.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ArtifactError
from ..phases import PHASES, RESIDUAL, SPAN_NAMES

__all__ = ["LEDGER_DIR", "Ledger", "LedgerRecord", "StepLedger", "find_ledgers", "ledger_step_rows", "read_ledger",
           "unrecorded_tails"]

LEDGER_DIR = "ledger"
MAGIC = b"SWLEDGR1"
VERSION = 2
READS = (1, 2)
HEADER = struct.Struct("<8sIIIiiqqq40s")
HEADER_SIZE = 128
_FORMAT = "Qqqq" + "q" * len(PHASES) + "Q"  # seq, index, start, end, the phases, seq
RECORD = struct.Struct("<" + _FORMAT)
# The writer packs in the machine's own order and sizes when that is the file's (little-endian,
# 8-byte fields, no padding): struct's native codes convert an int in a few instructions, its
# standard ones go through a generic byte-array conversion (about 1k instructions a step more).
_WRITE = (struct.Struct("@" + _FORMAT) if sys.byteorder == "little" and struct.calcsize("@" + _FORMAT) == RECORD.size
          else RECORD)
_NO_TIMES = dict.fromkeys(SPAN_NAMES, 0)
_TIMES = itemgetter(*SPAN_NAMES)
_SIZE = RECORD.size
_ALIVE_AT = struct.Struct("<q")
_ALIVE_OFFSET = 8 + 4 * 5 + 8  # after magic, version, record_size, capacity, rank, pid, started_ns
_CLOSED_OFFSET = _ALIVE_OFFSET + 8
DEFAULT_CAPACITY = 4096  # 320 kB: seconds of steps at 1,000 steps/s, more than a seal's window
_MAX_CAPACITY = 1 << 24
_I64_MAX = (1 << 63) - 1


class LedgerRecord(NamedTuple):
    seq: int
    index: int
    start_ns: int
    end_ns: int
    phases: tuple[int, ...]  # by stepwatch.phases order; a version-1 file has the first five


class Ledger(NamedTuple):
    """One ledger file read back: its header, its whole records (oldest first), and how many
    slots held a record cut short or corrupt (``skipped``)."""

    path: Path
    session_id: str
    rank: int
    pid: int
    started_ns: int
    alive_ns: int
    closed_ns: int
    capacity: int
    records: list[LedgerRecord]
    skipped: int


class StepLedger:
    """The writing side, in the training process. ``write`` is on the step path: one
    ``pack_into`` into the mapping, no allocation kept, no system call.

    Example::

        ledger = StepLedger.create(run_dir, session_id, rank=0)
        ledger.write(index, start_ns, end_ns, phase_ns)   # each closed step
        ledger.alive(time.time_ns())                      # from the sampler, each tick
        ledger.close(time.time_ns())                      # a clean stop
    """

    __slots__ = ("_base", "_file", "_map", "_mask", "_pack", "_seq", "capacity", "path")

    def __init__(self, path: Path, fd: int, size: int, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self._file = fd
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mask = capacity - 1
        self._base = HEADER_SIZE
        self._pack = _WRITE.pack_into
        self._seq = 0

    @classmethod
    def create(cls, run_dir: Path, session_id: str, *, rank: int, started_ns: int = 0,
               capacity: int = DEFAULT_CAPACITY) -> StepLedger:
        """A new ledger file, allocated in full. Raises OSError (no room, no mmap): the caller
        runs without one."""
        if capacity <= 0 or capacity & (capacity - 1) or capacity > _MAX_CAPACITY:
            raise ValueError(f"ledger capacity must be a power of two up to {_MAX_CAPACITY}, got {capacity}")
        directory = Path(run_dir) / LEDGER_DIR
        directory.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        path = directory / f"rank{rank}-{pid}.steps"
        size = HEADER_SIZE + capacity * RECORD.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            header = HEADER.pack(MAGIC, VERSION, RECORD.size, capacity, rank, pid, started_ns, 0, 0,
                                 session_id.encode("ascii", "replace")[:40])
            os.write(fd, header.ljust(HEADER_SIZE, b"\0"))
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)  # every page has its block now: no SIGBUS later
            else:  # pragma: no cover - macOS: write the zeros out
                os.ftruncate(fd, size)
                os.pwrite(fd, bytes(size - HEADER_SIZE), HEADER_SIZE)
            return cls(path, fd, size, capacity)
        except BaseException:
            os.close(fd)
            try:
                path.unlink()
            except OSError:
                pass
            raise

    def write(self, index: int, start_ns: int, end_ns: int, times: Mapping[str, int] | None) -> None:
        """One closed step (``times``: its phase times by name; None: no breakdown)."""
        seq = self._seq + 1
        self._seq = seq
        t = times or _NO_TIMES
        self._pack(self._map, HEADER_SIZE + ((seq - 1) & self._mask) * RECORD.size, seq, index, start_ns, end_ns,
                   *(t.get(name, 0) for name in SPAN_NAMES), seq)

    def write_step(self, span: Any) -> None:
        """``write`` for a closed step span (capture/spans.py ``OpenSpan``), the runtime's hook:
        the least Python between the step's close and the copy (measured with callgrind, see
        docs/crash-safety.md). Eval steps are not the history's steps: left out."""
        if span.name != "step":
            return
        seq = self._seq + 1
        self._seq = seq
        self._pack(self._map, HEADER_SIZE + ((seq - 1) & self._mask) * _SIZE, seq, span.index, span.start_ns,
                   span.end_ns, *_TIMES(span.phase_ns or _NO_TIMES), seq)

    def alive(self, now_ns: int) -> None:
        """The sampler's sign of life: how long after its last step a killed rank still ran."""
        _ALIVE_AT.pack_into(self._map, _ALIVE_OFFSET, now_ns)

    def close(self, now_ns: int) -> None:
        """A clean stop: every step also went the ordinary way, and nothing after is missing."""
        try:
            _ALIVE_AT.pack_into(self._map, _ALIVE_OFFSET, now_ns)
            _ALIVE_AT.pack_into(self._map, _CLOSED_OFFSET, now_ns)
            self._map.close()
        finally:
            os.close(self._file)


def read_ledger(path: str | os.PathLike[str]) -> Ledger:
    """One ledger file. A file whose header is not a ledger's raises ``ArtifactError`` naming
    it; a record cut short or corrupt is skipped and counted, never raised."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ArtifactError(file, f"cannot read: {exc.strerror or exc}") from exc
    if len(data) < HEADER.size:
        raise ArtifactError(file, f"not a step ledger: {len(data)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, record_size, capacity, rank, pid, started_ns, alive_ns, closed_ns, raw_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ArtifactError(file, f"not a step ledger: magic {magic!r}, expected {MAGIC!r}")
    if version not in READS:
        raise ArtifactError(file, f"step ledger version {version} is not supported (this reader: {READS})")
    expected = 8 * (5 + (5 if version == 1 else len(PHASES)))
    if record_size != expected:
        raise ArtifactError(file, f"record_size: {record_size}, expected {expected} for version {version}")
    layout = struct.Struct("<Qqqq" + "q" * (record_size // 8 - 5) + "Q")
    if not 0 < capacity <= _MAX_CAPACITY:
        raise ArtifactError(file, f"capacity: {capacity} is out of range (1 to {_MAX_CAPACITY})")
    try:
        session_id = raw_id.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ArtifactError(file, "session_id: not ASCII") from None
    records: list[LedgerRecord] = []
    skipped = 0
    body = max(0, len(data) - HEADER_SIZE)
    slots = min(capacity, body // record_size)
    if slots < capacity and body % record_size:
        skipped += 1  # a file cut inside a record
    for slot in range(slots):
        values = layout.unpack_from(data, HEADER_SIZE + slot * record_size)
        seq, tail = values[0], values[-1]
        if seq == 0 and tail == 0 and not any(values[1:-1]):
            continue  # never written
        record = LedgerRecord(*values[:4], values[4:-1])
        if seq != tail or seq == 0 or (seq - 1) % capacity != slot or not _plausible(record):
            skipped += 1  # cut short by the kill, or damaged since
            continue
        records.append(record)
    records.sort(key=lambda r: r.seq)
    return Ledger(file, session_id, rank, pid, started_ns, alive_ns, closed_ns, capacity, records, skipped)


def _plausible(record: LedgerRecord) -> bool:
    if record.index < 0 or record.start_ns <= 0 or record.end_ns < record.start_ns:
        return False
    phases = record.phases
    return all(0 <= value <= _I64_MAX for value in phases) and sum(phases) <= _I64_MAX


def find_ledgers(run_dir: str | os.PathLike[str]) -> list[Path]:
    directory = Path(run_dir) / LEDGER_DIR
    return sorted(directory.glob("rank*.steps")) if directory.is_dir() else []


def _session_ledgers(run_dir: Path, session_id: str) -> Iterable[Ledger]:
    for path in find_ledgers(run_dir):
        try:
            ledger = read_ledger(path)
        except ArtifactError:
            continue  # not ours to judge here: ``stepwatch validate`` names it
        if ledger.session_id == session_id:
            yield ledger


def ledger_step_rows(run_dir: str | os.PathLike[str], session_id: str) -> list[dict[str, Any]]:
    """The session's steps as the history's ``steps`` rows (its columns), one per step index
    and rank (a step recorded twice, as when a ring wrapped, keeps its latest record)."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for ledger in _session_ledgers(Path(run_dir), session_id):
        for r in ledger.records:
            step_ns = r.end_ns - r.start_ns
            row = {"session_id": session_id, "rank": ledger.rank, "step": r.index, "start_ns": r.start_ns,
                   "end_ns": r.end_ns, "step_ns": step_ns}
            spent = 0
            for phase, value in zip(PHASES, r.phases):  # a version-1 record leaves recompute unknown
                row[phase.column] = value
                spent += value if phase.in_residual else 0
            rows[(ledger.rank, r.index)] = {**row, RESIDUAL.column: max(0, step_ns - spent)}
    return [rows[key] for key in sorted(rows)]


def unrecorded_tails(run_dir: str | os.PathLike[str], session_id: str) -> dict[str, dict[str, Any]]:
    """Ranks that died without a clean stop (``closed_ns`` 0): their last recorded step's end,
    and the last sign of life after it. What the rank did in between (at most the step then in
    progress, which the ledger takes only once it closes) is the tail no file holds."""
    tails: dict[str, dict[str, Any]] = {}
    for ledger in _session_ledgers(Path(run_dir), session_id):
        if ledger.closed_ns:
            continue
        last = ledger.records[-1] if ledger.records else None
        last_end = last.end_ns if last is not None else None
        tails[str(ledger.rank)] = {
            "pid": ledger.pid, "last_step": last.index if last is not None else None, "last_step_end_ns": last_end,
            "last_alive_ns": ledger.alive_ns or None,
            "unrecorded_ms": (round((ledger.alive_ns - last_end) / 1e6, 1)
                              if last_end is not None and ledger.alive_ns > last_end else None),
            "corrupt_records": ledger.skipped,
        }
    return tails
