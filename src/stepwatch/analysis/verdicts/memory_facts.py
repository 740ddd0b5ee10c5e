"""What the memory and system rules read, reduced once from a window's samples: the type both
reductions (row by row in ``memory_verdicts``, on numpy arrays in ``memory_arrays``) fill."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["COLUMNAR_MIN_SAMPLES", "CPU_COLLECTOR", "NVML_COLLECTOR", "MemoryFacts", "SeriesColumns"]

CPU_COLLECTOR = "stepwatch.cpu_tracker"
NVML_COLLECTOR = "stepwatch.nvml_tracker"
# from this many samples on, they are reduced on numpy arrays (where importable)
COLUMNAR_MIN_SAMPLES = 256


class SeriesColumns(dict):  # type: ignore[type-arg]
    """rank -> its series, each built on first use from the points' rows."""

    def __init__(self, order: list[int], rows: list[list[float]]) -> None:
        super().__init__()
        self._index = {rank: i for i, rank in enumerate(order)}
        self._rows = rows

    def __missing__(self, rank: int) -> list[float]:
        i = self._index[rank]
        series = self[rank] = [row[i] for row in self._rows]
        return series

    def ranks(self) -> list[int]:
        return sorted(self._index)



@dataclass
class MemoryFacts:
    """What the memory and system rules read, reduced once from the window's samples (row by
    row here, or on numpy arrays by ``memory_arrays``: the same facts)."""

    kind: str = ""  # "device", "rss", or "" with no sample to judge
    samples: int = 0  # samples of the judged memory
    peaks: dict[int, float] = field(default_factory=dict)  # per rank
    totals: dict[int, float] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    worst: list[float] = field(default_factory=list)  # the creep series (allocated), per sampled step
    median: list[float] = field(default_factory=list)
    own: Any = None  # rank -> its own series (SeriesColumns)
    host_used: dict[str, float] = field(default_factory=dict)  # system: a host's used fraction, peak
    host_ranks: dict[str, set[int]] = field(default_factory=dict)
    rss: dict[int, float] = field(default_factory=dict)  # system: a rank's RSS over its host's total, peak
