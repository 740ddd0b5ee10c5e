"""Bounded in-memory tables: the only thing the training thread touches.

``append`` is one ``deque.append`` (atomic under the GIL, no lock); past ``maxlen`` the oldest
row is evicted and counted. The background thread ``drain``s with ``popleft`` (also atomic), never
by iterating or swapping the deque, which a concurrent append would break. It drains a chunk at a
time (``limit``): rows it has taken out and not yet written are memory on top of the table's
bound, so a chunk keeps that extra small while the training thread refills the table.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import call as _call
from typing import Generic, TypeVar

__all__ = ["BoundedTable"]

T = TypeVar("T")


class BoundedTable(Generic[T]):
    """A fixed-capacity FIFO whose overflow is counted, not raised.

    Example::

        table = BoundedTable[tuple](maxlen=10_000)
        table.append(row)            # training thread
        rows = table.drain()         # background thread
    """

    __slots__ = ("name", "maxlen", "_rows", "appended", "_drained")

    def __init__(self, name: str, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"table {name}: maxlen must be >= 1, got {maxlen}")
        self.name = name
        self.maxlen = maxlen
        self._rows: deque[T] = deque(maxlen=maxlen)
        self.appended = 0  # rows ever appended (approximate under races; only ever grows)
        self._drained = 0

    def append(self, row: T) -> None:
        self._rows.append(row)
        self.appended += 1

    def extend(self, rows: list[T]) -> None:
        """Appends ``rows`` in order (one C call: the sampler's batch of inferred marks)."""
        self._rows.extend(rows)
        self.appended += len(rows)

    def drain(self, limit: int | None = None) -> list[T]:
        """Takes the rows appended so far (at most ``limit`` of them), oldest first."""
        rows = self._rows
        count = len(rows) if limit is None else min(limit, len(rows))
        # ``count`` poplefts in one C-level loop (no Python frame per row). Only this thread
        # takes rows out, and an append past the bound evicts from the left but never shrinks
        # the deque: the ``count`` rows seen above are there to take.
        out: list[T] = list(map(_call, repeat(rows.popleft, count)))
        self._drained += len(out)
        return out

    @property
    def evicted(self) -> int:
        """Rows lost to the bound: appended but never drained."""
        return max(0, self.appended - self._drained - len(self._rows))

    def __len__(self) -> int:
        return len(self._rows)
