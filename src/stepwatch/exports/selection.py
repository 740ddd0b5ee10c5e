"""What part of a run an export takes: ``--steps A:B`` and ``--ranks 0,2,4-7``, parsed once
with errors that say what was wrong and how to write it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["StepRange", "parse_ranks", "parse_steps"]

_MAX_RANK = 1 << 20  # no launcher starts more ranks; a typo (a step number) is caught here


class StepRange(NamedTuple):
    """Steps ``start`` (inclusive) to ``stop`` (exclusive), as a Python slice; None: open."""

    start: int | None
    stop: int | None

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return (self.start is None or step >= self.start) and (self.stop is None or step < self.stop)


def parse_steps(text: str) -> StepRange:
    """``A:B`` (steps A to B-1, as a Python slice), ``A:`` (from A on), ``:B`` (before B) or ``N``
    (step N alone). ValueError saying what is wrong otherwise (an empty range included)."""
    value = text.strip()
    if not value:
        raise ValueError("empty step range; write A:B (steps A to B-1), A:, :B or N")
    if ":" not in value:
        step = _step(value, text)
        return StepRange(step, step + 1)
    head, _, tail = value.partition(":")
    start = _step(head, text) if head.strip() else None
    stop = _step(tail, text) if tail.strip() else None
    if start is not None and stop is not None and stop <= start:
        raise ValueError(f"step range {text!r} is empty: B must be greater than A in A:B (steps A to B-1)")
    return StepRange(start, stop)


def _step(part: str, text: str) -> int:
    part = part.strip()
    if not part.isascii() or not part.isdigit():
        raise ValueError(f"step range {text!r}: {part!r} is not a step number (a non-negative integer); "
                         "write A:B (steps A to B-1), A:, :B or N")
    return int(part)


def parse_ranks(text: str) -> frozenset[int]:
    """``0,2,4-7`` (commas between ranks and inclusive ranges ``A-B``; spaces allowed) as a set
    of ranks. ValueError naming the bad part otherwise."""
    ranks: set[int] = set()
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise ValueError("no ranks given; write a list such as 0,2,4-7")
    for part in parts:
        if not part:
            raise ValueError(f"ranks {text!r}: an empty item between commas")
        low, dash, high = part.partition("-")
        first = _rank(low, part, text)
        last = _rank(high, part, text) if dash else first
        if last < first:
            raise ValueError(f"ranks {text!r}: range {part!r} runs backwards (write {last}-{first})")
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def _rank(value: str, part: str, text: str) -> int:
    value = value.strip()
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"ranks {text!r}: {part!r} is not a rank or a range A-B of ranks")
    rank = int(value)
    if rank >= _MAX_RANK:
        raise ValueError(f"ranks {text!r}: rank {rank} is out of range (at most {_MAX_RANK - 1})")
    return rank
