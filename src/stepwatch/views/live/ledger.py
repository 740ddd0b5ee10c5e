"""The step ledgers of a run directory (``ledger/rank<R>-<pid>.steps``), mapped read-only: each
rank's last steps and its sampler's signs of life, read in place with numpy, so a refresh costs
the same at step 100 and step 10 million. A ledger still being allocated is asked again next
refresh; one replaced or cut under the reader is mapped anew, never read past its end."""

from __future__ import annotations

import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

from ...artifacts.step_ledger import HEADER, HEADER_SIZE, LEDGER_DIR, MAGIC, READS

__all__ = ["LedgerDirectory", "MappedLedger"]

_LEDGER_NAME = re.compile(r"^rank(\d+)-(\d+)\.steps$")
_U64 = struct.Struct("<Q")


class MappedLedger:
    """One step ledger, mapped read-only. The ring's records are viewed in place as a numpy
    structured array; each read copies out only the last records asked for."""

    def __init__(self, path: Path) -> None:
        import numpy as np

        self.path = path
        with path.open("rb") as file:
            head = file.read(HEADER_SIZE)
            if len(head) < HEADER.size:
                raise ValueError("short header")
            magic, version, record_size, capacity, rank, pid, started_ns, _, _, raw_id = HEADER.unpack_from(head)
            if magic != MAGIC or version not in READS or record_size % 8 or record_size < 48 or capacity <= 0:
                raise ValueError("not a step ledger")
            stat = os.fstat(file.fileno())
            full = HEADER_SIZE + capacity * record_size
            if stat.st_size < full:  # still being allocated (or cut short): asked again next refresh
                raise ValueError("not allocated in full")
            self.map = mmap.mmap(file.fileno(), full, access=mmap.ACCESS_READ)
            self.inode, self.size = stat.st_ino, full
        self.rank, self.pid, self.started_ns = rank, pid, started_ns
        self.session_id = raw_id.rstrip(b"\0").decode("ascii", "replace")
        self.phases = record_size // 8 - 5
        self.record_size = record_size
        self._newest = 0
        self.capacity = capacity
        self.dtype = np.dtype([("seq", "<u8"), ("index", "<i8"), ("start", "<i8"), ("end", "<i8"),
                               ("phases", "<i8", (self.phases,)), ("tail", "<u8")])

    def intact(self) -> bool:
        """The file is still the one mapped, at its full size: reading a mapped page a truncated
        file no longer has would kill this process (SIGBUS), so a changed file is mapped anew."""
        try:
            stat = self.path.stat()
        except OSError:
            return False
        return stat.st_ino == self.inode and stat.st_size >= self.size

    def header_times(self) -> tuple[int, int]:
        """(alive_ns, closed_ns): the sampler's last sign of life, the clean stop (0: none)."""
        _, _, _, _, _, _, _, alive_ns, closed_ns, _ = HEADER.unpack_from(self.map, 0)
        return alive_ns, closed_ns

    def _whole(self, seq: int) -> bool:
        """Record ``seq`` sits whole in its slot (its first and last words both say ``seq``)."""
        offset = HEADER_SIZE + ((seq - 1) % self.capacity) * self.record_size
        if offset + self.record_size > len(self.map):
            return False
        return bool(_U64.unpack_from(self.map, offset)[0] == seq
                    == _U64.unpack_from(self.map, offset + self.record_size - 8)[0])

    def newest(self) -> int:
        """The newest whole record's sequence number (0: none). From the last one known, a
        binary search over the ring's next ``capacity`` numbers (a dozen reads: record n lives in
        slot n - 1 modulo capacity, whole up to the newest); a full scan when the ring lapped
        the last one known, or at first."""
        known = self._newest
        if known and self._whole(known):
            low, high = known, known + self.capacity
            while high - low > 1:
                middle = (low + high) // 2
                if self._whole(middle):
                    low = middle
                else:
                    high = middle
            self._newest = low
            return low
        import numpy as np

        records = np.frombuffer(self.map, dtype=self.dtype, count=self.capacity, offset=HEADER_SIZE)
        try:
            seq = records["seq"]
            whole = (seq == records["tail"]) & (seq > 0)
            self._newest = int(seq[whole].max()) if whole.any() else 0
        finally:
            del records  # no view may outlive the mapping
        return self._newest

    def window(self, size: int) -> Any:
        """The last ``size`` whole records, oldest first (a numpy structured array, copied)."""
        import numpy as np

        newest = self.newest()
        first = max(1, newest - min(size, self.capacity) + 1)
        if newest == 0:
            return np.zeros(0, dtype=self.dtype)
        start_slot, end_slot = (first - 1) % self.capacity, (newest - 1) % self.capacity
        pieces = [(start_slot, end_slot + 1)] if start_slot <= end_slot else [(start_slot, self.capacity),
                                                                               (0, end_slot + 1)]
        parts = []
        for low, high in pieces:
            view = np.frombuffer(self.map, dtype=self.dtype, count=high - low,
                                 offset=HEADER_SIZE + low * self.record_size)
            parts.append(view.copy())
            del view  # no view may outlive the mapping
        chosen = np.concatenate(parts) if len(parts) > 1 else parts[0]
        seq = chosen["seq"]
        keep = ((seq == chosen["tail"]) & (seq >= first) & (seq <= newest) & (chosen["end"] >= chosen["start"])
                & (chosen["start"] > 0))
        return chosen[keep]

    def close(self) -> None:
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass


class LedgerDirectory:
    """The run directory's ledgers, each mapped once and kept for the reader's life."""

    def __init__(self, run_dir: Path) -> None:
        self.directory = run_dir / LEDGER_DIR
        self._ledgers: dict[Path, MappedLedger] = {}

    def newest_per_rank(self, session_id: str | None) -> dict[int, MappedLedger]:
        """Each rank's newest ledger of ``session_id``; with none given, of the newest ledger's
        session (a rank restarted in the same directory leaves its older ledgers behind)."""
        newest: dict[int, MappedLedger] = {}
        for ledger in self._open():
            if session_id is not None and ledger.session_id != session_id:
                continue
            if ledger.rank not in newest or ledger.started_ns > newest[ledger.rank].started_ns:
                newest[ledger.rank] = ledger
        if session_id is None and newest:
            session_id = max(newest.values(), key=lambda led: led.started_ns).session_id
            newest = {r: led for r, led in newest.items() if led.session_id == session_id}
        return newest

    def _open(self) -> list[MappedLedger]:
        try:
            paths = [p for p in self.directory.iterdir() if _LEDGER_NAME.match(p.name)]
        except OSError:
            paths = []
        for path, known in list(self._ledgers.items()):
            if not known.intact():
                known.close()
                del self._ledgers[path]  # replaced or cut: mapped anew below
        for path in paths:
            if path not in self._ledgers:
                try:
                    self._ledgers[path] = MappedLedger(path)
                except (OSError, ValueError):
                    pass  # not (yet) a whole ledger (a header still being written): asked again next refresh
        return list(self._ledgers.values())

    def close(self) -> None:
        for ledger in self._ledgers.values():
            ledger.close()
        self._ledgers.clear()
