"""The step rows as numpy columns: what the step window is reduced on.

A summary judges every step of a run (64 ranks x 20,000 steps is 1.28M rows), the live view the
last 100 steps every few seconds; both reduce a few array passes over all ranks at once.
``load_verdict_inputs`` builds ``StepColumns`` straight from the history's tuples, ``diagnose``
builds it from row dicts when it gets rows. What a value means is decided here, once:

- a number (``step_ns`` and the phase columns): an int or a float (never a bool or a string),
  finite, ``>= 0`` and below 2**63 (no duration is that long); anything else is unknown (NaN);
- ``rank`` and ``step``: a whole number (an int, or a float without a fraction) in
  ``[0, 2**53)``; anything else makes the row unusable;
- a clock (``start_ns``, ``end_ns``): a whole number in ``[0, 2**63)``, held exactly as int64
  with a mask of the known ones (a float64 would round a nanosecond clock to 256 ns).

numpy is imported inside the functions, never at import, so ``import stepwatch`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ...phases import PHASES, STEP_COLUMNS

__all__ = ["CLOCKS", "COLUMNS", "COMPUTE_PHASES", "StepColumns", "clean_int", "clean_number", "clock_array",
           "number_array"]

COLUMNS: tuple[str, ...] = ("rank", "step", "start_ns", "end_ns", "step_ns", *STEP_COLUMNS)
CLOCKS: tuple[str, ...] = ("start_ns", "end_ns")
# the phases that make up compute (stepwatch.phases: in the residual, and not h2d)
COMPUTE_PHASES: tuple[str, ...] = tuple(p.share for p in PHASES if p.in_residual and p.share != "h2d")
_PAST_INT64 = 2.0**63
_TWO_63 = 1 << 63
_NUMBERS = frozenset({int, float, type(None)})


def clean_int(value: Any) -> int | None:
    """A whole number in int64's range (an int, or a float without a fraction), else None."""
    if type(value) is int:
        return value if -_TWO_63 <= value < _TWO_63 else None
    if type(value) is float and value.is_integer() and -_PAST_INT64 <= value < _PAST_INT64:
        return int(value)
    return None


def clean_number(value: Any) -> float | int | None:
    """A non-negative finite number below 2**63, or None (unknown): bools, strings, NaN,
    negatives are unknown. A subclass of int or float (numpy's float64) is its float."""
    kind = type(value)
    if kind is int:
        return value if 0 <= value < _TWO_63 and float(value) < _PAST_INT64 else None
    if kind is float:
        return value if 0 <= value < _PAST_INT64 else None  # NaN fails both comparisons
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            return None
        return number if 0 <= number < _PAST_INT64 else None
    return None


def _clock(value: Any) -> int:
    """A clock's nanoseconds, or -1 where unknown."""
    if type(value) is int:
        return value if 0 <= value < _TWO_63 else -1
    if type(value) is float and value.is_integer() and 0 <= value < _PAST_INT64:
        return int(value)
    return -1


def number_array(values: Sequence[Any], *, no_bools: bool = False) -> Any:
    """float64, NaN where the value is no number (see the module's rules). ``no_bools``: the
    values come from SQLite, which has no bool, so an int or float array inferred from them
    needs no check of each value's type (the history's common case, a third of the cost)."""
    import numpy as np

    kinds = None if no_bools else set(map(type, values))  # one C pass: no bool, no str read as a number
    if no_bools or kinds == {int}:
        try:
            inferred = np.array(values)  # ints: int64, the common case and the fastest
        except (TypeError, ValueError, OverflowError):
            inferred = None
        if inferred is not None and inferred.ndim == 1 and inferred.dtype.kind in "if":
            return _only_numbers(np, inferred.astype(np.float64))
    if kinds is None:
        kinds = set(map(type, values))
    if kinds <= _NUMBERS:
        try:
            array = np.array(values, dtype=np.float64)
        except OverflowError:  # an int past float64
            array = None
        if array is not None and array.ndim == 1:
            return _only_numbers(np, array)
    cleaned = (clean_number(v) for v in values)
    return np.array([math.nan if c is None else c for c in cleaned], dtype=np.float64)


def _only_numbers(np: Any, array: Any) -> Any:
    """NaN where a value is negative, NaN, infinite or past int64 (in place)."""
    with np.errstate(invalid="ignore"):
        array[~((array >= 0) & (array < _PAST_INT64))] = np.nan  # NaN fails both comparisons
    return array


def clock_array(values: Sequence[Any], *, no_bools: bool = False) -> tuple[Any, Any]:
    """(int64 nanoseconds, which are known): exact, 0 where unknown. ``no_bools``: as for
    ``number_array``."""
    import numpy as np

    array = None
    if no_bools or set(map(type, values)) == {int}:  # the common case: every clock an int
        try:
            array = np.array(values)
        except (TypeError, ValueError, OverflowError):
            array = None
        if array is not None and (array.ndim != 1 or array.dtype != np.int64):
            array = None
    if array is None:
        array = np.array([_clock(v) for v in values], dtype=np.int64)
    known = array >= 0
    if not known.all():
        array = np.where(known, array, 0)
    return array, known


class StepColumns(Sequence[Mapping[str, Any]]):
    """Step rows held as one array per column: float64 with NaN where unknown, and the clocks as
    exact int64 with a mask (``known``). Reads as a sequence of row dicts too, so a caller that
    iterates rows still can. ``skipped``: items of the input that were no row mapping (the window
    counts them with the rows it ignores)."""

    def __init__(self, arrays: Mapping[str, Any], known: Mapping[str, Any], length: int, skipped: int = 0) -> None:
        self.arrays = dict(arrays)
        self.known = dict(known)
        self.length = length
        self.skipped = skipped

    @classmethod
    def from_lists(cls, columns: Mapping[str, Sequence[Any]], *, no_bools: bool = False) -> StepColumns:
        """From one list per column (None: unknown; a column not given: unknown throughout)."""
        length = len(next(iter(columns.values()))) if columns else 0
        arrays: dict[str, Any] = {}
        known: dict[str, Any] = {}
        for name in COLUMNS:
            values = columns.get(name)
            if values is None:
                values = [None] * length
            if name in CLOCKS:
                arrays[name], known[name] = clock_array(values, no_bools=no_bools)
            else:
                arrays[name] = number_array(values, no_bools=no_bools)
        return cls(arrays, known, length)

    @classmethod
    def from_rows(cls, rows: Iterable[Any]) -> StepColumns:
        """From row mappings (anything else in the sequence is skipped)."""
        given = rows if isinstance(rows, list | tuple) else list(rows)
        mappings = [r for r in given if type(r) is dict or isinstance(r, Mapping)]  # the ABC check only for others
        try:
            lists = {name: [r[name] for r in mappings] for name in COLUMNS}
        except KeyError:
            lists = {name: [r.get(name) for r in mappings] for name in COLUMNS}
        columns = cls.from_lists(lists)
        columns.skipped = len(given) - len(mappings)
        return columns

    @classmethod
    def from_tuples(cls, rows: list[tuple[Any, ...]]) -> StepColumns:
        """From tuples in ``COLUMNS`` order (the history's SELECT: SQLite gives no bool)."""
        lists = list(zip(*rows)) if rows else [() for _ in COLUMNS]
        return cls.from_lists(dict(zip(COLUMNS, lists)), no_bools=True)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.length))]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(index)
        return {name: self._value(name, index) for name in COLUMNS}

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        for i in range(self.length):
            yield self[i]

    def _value(self, name: str, index: int) -> Any:
        if name in CLOCKS:
            return int(self.arrays[name][index]) if self.known[name][index] else None
        value = float(self.arrays[name][index])
        return None if value != value else (int(value) if value.is_integer() else value)

    def span(self) -> tuple[int, int] | None:
        """(the earliest known start, the latest known end), None unless both are known somewhere."""
        starts = self.arrays["start_ns"][self.known["start_ns"]]
        ends = self.arrays["end_ns"][self.known["end_ns"]]
        return (int(starts.min()), int(ends.max())) if len(starts) and len(ends) else None

    def take(self, index: Any) -> StepColumns:
        """The rows ``index`` selects (a boolean mask or positions), in its order."""
        arrays = {name: array[index] for name, array in self.arrays.items()}
        return StepColumns(arrays, {name: mask[index] for name, mask in self.known.items()},
                           len(arrays["rank"]), self.skipped)

    def by_rank_and_step(self) -> StepColumns:
        """The rows ordered by (rank, step): a read in storage order gets the order an index
        read would have given, for one sort instead of one random row access per row."""
        import numpy as np

        order = np.lexsort((self.arrays["step"], self.arrays["rank"]))
        return self.take(order)
