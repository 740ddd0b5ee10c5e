"""Bounds on what arrives from the wire: ids, names, hosts, ranks and world sizes.

A frame or HTTP batch is stored for good, and its sender fields create a session, so whatever a
sender claims must have a bounded length and a sane shape before anything of it is kept: a
100,000-character session id, one holding a NUL byte, or a rank of 10^12 is refused with a
counted reason, creating nothing. Every legitimate producer stays well inside the bounds
(docs/ingestion-limits.md): stepwatch's, cirron-sdk's and Stormlog's ids are UUIDs or 32 hex
characters, both capture libraries cut names to 256 UTF-8 bytes.

Where they are checked (docs/ingestion-limits.md): sender fields once per sender; on the typed
fast path msgspec checks lengths and ranges in C while it decodes (transport/frames.py) and
``shape_problem`` the ids' shape, one column at a time; on the general path ``rows_problem``
checks every bound, over a column's distinct values where it repeats them. Only C-level passes
per column (``map``, ``str.join``, ``isascii``, ``bytes.translate``), no Python frame per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

__all__ = [
    "MAX_HOST_BYTES",
    "MAX_ID_CHARS",
    "MAX_NAME_BYTES",
    "MAX_RANK",
    "MAX_WORLD_SIZE",
    "bounded_columns",
    "column_problem",
    "id_problem",
    "rows_problem",
    "sender_problem",
    "shape_problem",
]

MAX_ID_CHARS = 128
"""Session, batch, span, mark and snapshot ids: 1 to 128 printable ASCII characters (space to ``~``)."""
MAX_NAME_BYTES = 256
"""Span, mark and tensor names, event types, collectors: at most 256 UTF-8 bytes."""
MAX_HOST_BYTES = 256
"""Host names: at most 256 UTF-8 bytes, no control characters."""
MAX_RANK = (1 << 20) - 1
"""Ranks (and local ranks): 0 to 2**20 - 1."""
MAX_WORLD_SIZE = 1 << 20
"""World sizes: 1 to 2**20."""

# store column name -> what it holds (the columns the wire fills from what a sender claims):
# "id" columns hold a new value in almost every row (span and mark ids) and are checked as they
# are; the others repeat a few values per frame and are checked over their distinct values.
_KIND_OF_COLUMN = {
    "span_id": "id", "parent_id": "id", "mark_id": "id", "snapshot_id": "id", "session_id": "session",
    "name": "name", "event_type": "name", "collector": "name", "tensor_name": "name",
    "host": "host", "rank": "rank", "world_size": "world_size",
}
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def _present(values: Iterable[Any]) -> list[Any]:
    """The values less None (and the empty string and zero, which no bound concerns), in C."""
    return list(filter(None, values))


def _joined(texts: list[Any]) -> tuple[list[str], str]:
    try:
        return texts, "".join(texts)
    except TypeError:  # numbers, which the text columns also take: checked by their digits
        texts = list(map(str, texts))
        return texts, "".join(texts)


def _first_unprintable(joined: str) -> str:
    return next(ch for ch in joined if not (ch.isascii() and ch.isprintable()))


def _ids_problem(values: Iterable[Any]) -> str | None:
    texts, joined = _joined(_present(values))
    if not texts:
        return None
    longest = max(map(len, texts))
    if longest > MAX_ID_CHARS:
        return f"an id of {longest} characters (at most {MAX_ID_CHARS})"
    # isascii is O(1); deleting the printable bytes leaves the others (1 ns a character)
    if not joined.isascii() or joined.encode("ascii").translate(None, _PRINTABLE_ASCII):
        return f"an id holding {_first_unprintable(joined)!r} (ids are printable ASCII)"
    return None


def _names_problem(values: Iterable[Any], limit: int, what: str, printable: bool) -> str | None:
    texts, joined = _joined(_present(values))
    if not texts:
        return None
    longest = max(map(len, texts))
    if longest * 4 > limit:  # only then can a name be over the limit in UTF-8 bytes
        size = longest if joined.isascii() else max(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > limit:
            return f"a {what} of {size} UTF-8 bytes (at most {limit})"
    if printable and not joined.isprintable():
        bad = next(ch for ch in joined if not ch.isprintable())
        return f"a {what} holding {bad!r} (no control characters)"
    return None


def _range_problem(values: set[Any], low: int, high: int, what: str) -> str | None:
    values.discard(None)
    if not values:
        return None
    odd = next((v for v in values if type(v) is not int), None)  # distinct values: a few at most
    if odd is not None:
        return f"a {what} of {_short(odd)} (an integer expected)"
    smallest, largest = min(values), max(values)
    if smallest < low or largest > high:
        return f"a {what} of {smallest if smallest < low else largest} (from {low} to {high})"
    return None


def column_problem(kind: str, values: Iterable[Any]) -> str | None:
    """Why ``values``, a column of ``kind`` (as ``bounded_columns`` names them), break its
    bound, or None. ``None`` values (an absent parent, host or rank) are not checked here; the
    store's checks type them."""
    if kind == "id":
        return _ids_problem(values)
    if kind == "session":
        return _ids_problem(set(values))
    if kind == "name":
        return _names_problem(set(values), MAX_NAME_BYTES, "name", printable=False)
    if kind == "host":
        return _names_problem(set(values), MAX_HOST_BYTES, "host", printable=True)
    if kind == "rank":
        return _range_problem(set(values), 0, MAX_RANK, "rank")
    if kind == "world_size":
        return _range_problem(set(values), 1, MAX_WORLD_SIZE, "world size")
    raise KeyError(kind)


def id_problem(value: Any) -> str | None:
    """Why ``value`` is not an id stepwatch accepts (a non-empty string of at most 128 printable
    ASCII characters), or None."""
    if type(value) is not str or not value:
        return f"must be a non-empty string, got {_short(value)}"
    return _ids_problem([value])


def sender_problem(session_id: Any, rank: Any, world_size: Any = None, host: Any = None) -> tuple[str, str] | None:
    """``(field, why)`` of the first sender field (of a frame's meta, or an HTTP batch's
    session) that breaks its bound, or None when all hold; ``world_size`` and ``host`` may be
    absent (None)."""
    problem = id_problem(session_id)
    if problem is not None:
        return "session_id", problem
    if type(rank) is not int or not 0 <= rank <= MAX_RANK:
        return "rank", f"must be an integer from 0 to {MAX_RANK}, got {_short(rank)}"
    if world_size is not None and (type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE):
        return "world_size", f"must be an integer from 1 to {MAX_WORLD_SIZE}, got {_short(world_size)}"
    if host is not None:
        problem = (f"must be a string, got {type(host).__name__}" if type(host) is not str
                   else _names_problem([host], MAX_HOST_BYTES, "host", printable=True))
        if problem is not None:
            return "host", problem
    return None


def bounded_columns(columns: Sequence[str], skip: Iterable[str] = ()) -> tuple[tuple[str, int, str], ...]:
    """(column, index, kind) of the bounded columns among a table's ``columns``, less ``skip``."""
    left_out = set(skip)
    return tuple((name, index, _KIND_OF_COLUMN[name]) for index, name in enumerate(columns)
                 if name in _KIND_OF_COLUMN and name not in left_out)


def rows_problem(table: str, rows: list[tuple[Any, ...]], bounded: tuple[tuple[str, int, str], ...]) -> str | None:
    """Why the row tuples of ``table`` break a bound (``table.column: why``), or None. One pass
    per bounded column, over its distinct values (a frame's thousands of rows name a few
    sessions, hosts and event types)."""
    if not rows:
        return None
    for name, index, kind in bounded:
        problem = column_problem(kind, map(itemgetter(index), rows))
        if problem is not None:
            return f"{table}.{name}: {problem}"
    return None


def shape_problem(table: str, rows: list[tuple[Any, ...]], shaped: tuple[tuple[str, int, str], ...]) -> str | None:
    """``rows_problem`` less what msgspec already checked while decoding typed wire rows
    (transport/frames.py: lengths and ranges): the shape of the ids (printable ASCII) and of
    the hosts (no control characters), ``shaped`` naming their (column, index, kind)."""
    for name, index, kind in shaped:
        if kind == "id":  # a new id in almost every row: the column joined, in one C pipeline
            try:
                joined = "".join(filter(None, map(itemgetter(index), rows)))
            except TypeError:  # a number where text goes: only the general path lets those through
                return rows_problem(table, rows, ((name, index, kind),))
            if not joined.isascii() or joined.encode("ascii").translate(None, _PRINTABLE_ASCII):
                return f"{table}.{name}: {column_problem(kind, map(itemgetter(index), rows))}"
            continue
        # a session or a host: one value for the whole frame, as a rule (counted in C)
        column = list(map(itemgetter(index), rows))
        first = column[0]
        problem = (column_problem(kind, [first]) if column.count(first) == len(column)
                   else column_problem(kind, column))
        if problem is not None:
            return f"{table}.{name}: {problem}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
