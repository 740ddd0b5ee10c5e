"""Records as they are written (telemetry events, spool spans/marks/snapshots, heartbeat lines)
turned into store rows. The aggregator, the importers and the summary share these, so a row
means the same whichever way it arrived.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..phases import PHASES, STEP_ATTRS, STEP_COLUMNS
from ..schema.tables import fields, record_reader
from ..schema.wire import WireTables
from .base import COLUMNS

__all__ = ["PhaseCarry", "check_rows", "derive_steps", "heartbeat_row", "json_texts", "mark_row", "row_tuples",
           "snapshot_row", "span_row", "step_row", "telemetry_row", "to_rows", "wire_tuples"]


# Rows copied field for field from a record, written out from their tables' declarations.
telemetry_row = record_reader("telemetry")
telemetry_row.__doc__ = "A telemetry record (a TelemetryEventV3 as a mapping) as a ``telemetry`` row."
_span_fields = record_reader("spans", skip_session=True)
_snapshot_fields = record_reader("snapshots", skip_session=True)


def span_row(s: Mapping[str, Any], session_id: str, rank: int | None = None) -> dict[str, Any]:
    return {"session_id": session_id, "rank": s.get("rank", 0) if rank is None else rank, **_span_fields(s)}


def step_row(s: Mapping[str, Any], session_id: str, rank: int | None = None) -> dict[str, Any] | None:
    """The per-step phase row of a ``step`` span whose attrs carry the phase times (stepwatch's
    own steps); None otherwise (``derive_steps`` builds those of other producers' steps)."""
    attrs = s.get("attrs") or {}
    if s.get("name") != "step" or "step_ns" not in attrs:
        return None
    return {
        "session_id": session_id, "rank": s.get("rank", 0) if rank is None else rank,
        "step": s.get("index") if s.get("index") is not None else -1,
        "start_ns": s["start_ns"], "end_ns": s["end_ns"], "step_ns": attrs.get("step_ns"),
        **{column: attrs.get(attr, 0) for column, attr in zip(STEP_COLUMNS, STEP_ATTRS)},
    }


# -- step rows from the span tree -----------------------------------------------------------------
#
# stepwatch's step spans carry their phase breakdown in attrs; the cirron SDK's do not: its step
# span has children named after the phases (spool-format-v1.md "Canonical scope shape"). For
# those the step row is built from the tree: the step's duration from its start/end, each phase
# from the summed durations of its direct children of that name (two ``forward`` children, as
# when the loss module has its own, add up), ``data_load`` from the child's ``attrs.data_load_ns``
# where the SDK hides the real fetch time (spool-current-practice.md), and wait as the spec's
# residual, max(0, step - h2d - forward - backward - optimizer). Children close, and so ship,
# before their parent, so a step's children may come in an earlier batch: ``PhaseCarry`` keeps
# their times until the step comes.

_SLOT = {phase.span: slot for slot, phase in enumerate(PHASES)}  # a span name -> its phase's slot
_DATA_LOAD = _SLOT["data_load"]
_IN_RESIDUAL = [phase.in_residual for phase in PHASES]
_I64_LO, _I64_HI = -(1 << 63), (1 << 63) - 1

# (id, parent_id, name, index, start_ns, end_ns, attrs) of one span, from a dict or a WireSpan
SpanView = tuple[Any, Any, Any, Any, Any, Any, Any]


class PhaseCarry:
    """Phase times of children whose step was not in their batch, per (session, rank, step id),
    for the batch that brings the step. Bounded (oldest dropped first). Not kept for the
    (session, rank) pairs seen sending steps with their breakdown (``native``), so stepwatch's
    own frames pay one set lookup for it."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.times: dict[tuple[str, int, str], list[int]] = {}
        self.native: set[tuple[str, int]] = set()

    def wants(self, session_id: str, rank: int) -> bool:
        """Whether this sender's batches are read for their phase spans even with no bare step."""
        return (session_id, rank) not in self.native

    def apply(self, update: CarryUpdate) -> None:
        """Commits what one accepted batch took from and left for later batches."""
        times = self.times
        for key in update.taken:
            times.pop(key, None)
        if update.native is not None:
            self.native.add(update.native)
        for key, value in update.left.items():
            known = times.get(key)
            times[key] = value if known is None else [a + b for a, b in zip(known, value)]
        if len(times) > self.limit:
            for key in list(times)[: len(times) - self.limit // 2]:
                del times[key]


class CarryUpdate:
    """What one batch would change in a ``PhaseCarry``; applied only once the batch is queued, so
    a batch that the fast path hands to the general path is not counted twice."""

    __slots__ = ("taken", "left", "native")

    def __init__(self) -> None:
        self.taken: list[tuple[str, int, str]] = []
        self.left: dict[tuple[str, int, str], list[int]] = {}
        self.native: tuple[str, int] | None = None  # the batch had steps with their breakdown


def _span_ns(start: Any, end: Any) -> int | None:
    if type(start) is not int or type(end) is not int:
        return None
    value = end - start
    return value if _I64_LO <= value <= _I64_HI else None


def derive_steps(session_id: str, rank: int, spans: list[SpanView], carry: PhaseCarry | None = None,
                 update: CarryUpdate | None = None) -> list[tuple[Any, ...]]:
    """Step tuples (COLUMNS["steps"] order) for the ``step`` spans without ``attrs.step_ns``,
    from the span tree (see above). A step whose times are not 64-bit integers gets no row, as
    before, rather than failing its batch. ``carry``/``update``: children from earlier batches
    are looked up in ``carry``; what this batch takes and leaves goes into ``update``."""
    bare = [s for s in spans if s[2] == "step" and not (s[6] and "step_ns" in s[6])]
    if not bare and not (carry is not None and carry.wants(session_id, rank)):
        return []
    phases: dict[Any, list[int]] = {}
    for _span_id, parent, name, _index, start, end, attrs in spans:
        slot = _SLOT.get(name) if type(name) is str else None
        if slot is None or type(parent) is not str:
            continue
        took = _span_ns(start, end)
        if slot == _DATA_LOAD and type(attrs) is dict:
            hidden = attrs.get("data_load_ns")
            if type(hidden) is int and 0 <= hidden <= _I64_HI:
                took = hidden
        if took is None:
            continue
        times = phases.get(parent)
        if times is None:
            times = phases[parent] = [0] * len(PHASES)
        times[slot] += took
    rows = []
    for span_id, _parent, _name, index, start, end, _attrs in bare:
        step_ns = _span_ns(start, end)
        times = phases.pop(span_id, None) if type(span_id) is str else None
        if carry is not None and update is not None and type(span_id) is str:
            key = (session_id, rank, span_id)
            earlier = carry.times.get(key)
            if earlier is not None:
                update.taken.append(key)
                times = earlier if times is None else [a + b for a, b in zip(times, earlier)]
        if step_ns is None or not (index is None or type(index) is int):
            continue
        times = times or [0] * len(PHASES)
        wait = max(0, step_ns - sum(t for t, counted in zip(times, _IN_RESIDUAL) if counted))
        if not all(_I64_LO <= v <= _I64_HI for v in (*times, wait)):
            continue
        rows.append((session_id, rank, -1 if index is None else index, start, end, step_ns, *times, wait))
    if update is not None:
        steps_here = {s[0] for s in spans if s[2] == "step" and type(s[0]) is str}
        update.left = {(session_id, rank, parent): times for parent, times in phases.items()
                       if parent not in steps_here}
    return rows


def _views(spans: list[Mapping[str, Any]]) -> list[SpanView]:
    return [(s.get("id"), s.get("parent_id"), s.get("name"), s.get("index"), s.get("start_ns"), s.get("end_ns"),
             s.get("attrs")) for s in spans]


def mark_row(m: Mapping[str, Any], session_id: str, rank: int) -> dict[str, Any]:
    value = m.get("value")
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) or isinstance(value, bool)
    return {
        "session_id": session_id, "rank": rank, "mark_id": m["id"], "span_id": m.get("span_id"),
        "name": m["name"], "value_type": m.get("value_type"),
        "value_num": float(value) if numeric and value is not None else None,
        "value_text": value if isinstance(value, str) else m.get("value_nonfinite"),
        "ts_ns": m.get("ts_ns"), "kind": m.get("kind", "point"), "attrs": m.get("attrs") or {},
    }


def snapshot_row(s: Mapping[str, Any], session_id: str, rank: int) -> dict[str, Any]:
    return {"session_id": session_id, "rank": rank, **_snapshot_fields(s)}


_HEARTBEAT_CORE = ("ts", "iso", "pid", "rank", "step", "msg")


def heartbeat_row(h: Mapping[str, Any], session_id: str) -> dict[str, Any]:
    return {
        "session_id": session_id, "rank": h.get("rank", 0), "ts_ns": int(float(h["ts"]) * 1e9),
        "step": h.get("step", 0), "msg": h.get("msg"), "pid": h.get("pid"),
        "fields": {k: v for k, v in h.items() if k not in _HEARTBEAT_CORE},
    }


def to_rows(tables: Mapping[str, list[Mapping[str, Any]]], session_id: str, rank: int,
            carry: PhaseCarry | None = None, update: CarryUpdate | None = None) -> dict[str, list[dict[str, Any]]]:
    """Wire/artifact tables of one rank into store tables (spans also give step rows: from their
    attrs, or from the span tree, ``derive_steps``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if tables.get("telemetry"):
        out["telemetry"] = [telemetry_row(e) for e in tables["telemetry"]]
    if tables.get("spans"):
        spans = tables["spans"]
        out["spans"] = [span_row(s, session_id, rank) for s in spans]
        steps = [r for r in (step_row(s, session_id, rank) for s in spans) if r is not None]
        columns = [c for c, _ in COLUMNS["steps"]]
        if steps and update is not None:
            update.native = (session_id, rank)
        steps += [dict(zip(columns, row)) for row in derive_steps(session_id, rank, _views(spans), carry, update)]
        if steps:
            out["steps"] = steps
    if tables.get("marks"):
        out["marks"] = [mark_row(m, session_id, rank) for m in tables["marks"]]
    if tables.get("snapshots"):
        out["snapshots"] = [snapshot_row(s, session_id, rank) for s in tables["snapshots"]]
    if tables.get("heartbeat"):
        out["heartbeats"] = [heartbeat_row(h, session_id) for h in tables["heartbeat"]]
    return out


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_json = msgspec.json.Encoder()
_NUMBER = {type(None), int, float, bool}
_ALLOWED = {"text": _NUMBER | {str}, "int": _NUMBER, "real": _NUMBER}
# JSON columns that hold one object (a map of names), never a bare string, number or list:
# the readers look names up in them
_OBJECT_COLUMNS = frozenset({"attrs", "metadata", "stats", "fields", "evidence"})
_OBJECT = {type(None), dict}


def check_rows(table: str, rows: list[dict[str, Any]]) -> None:
    """Raises ValueError, naming the column, for a row the store cannot take: an integer over 64
    bits, text in a numeric column, a map or list outside a JSON column, a JSON column that does
    not encode, an object column (attrs, ...) that is no map. Checked where rows come in, so one
    sender's bad row never fails a shared write. Column at a time, so the common case costs a few
    C-level passes."""
    for name, kind in COLUMNS[table]:
        values = [row.get(name) for row in rows]
        if kind == "json":
            if name in _OBJECT_COLUMNS and not set(map(type, values)) <= _OBJECT:
                bad = next(type(v).__name__ for v in values if type(v) not in _OBJECT)
                raise ValueError(f"{table}.{name}: a {bad} where a map belongs")
            try:
                _json.encode(values)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"{table}.{name}: not encodable as JSON ({exc})") from None
            continue
        kinds = set(map(type, values))
        if not kinds <= _ALLOWED[kind]:
            bad = next(type(v).__name__ for v in values if type(v) not in _ALLOWED[kind])
            raise ValueError(f"{table}.{name}: a {bad} cannot be stored in a {kind} column")
        if int in kinds:
            ints = [v for v in values if type(v) is int]
            if min(ints) < _INT64_MIN or max(ints) > _INT64_MAX:
                raise ValueError(f"{table}.{name}: an integer outside the 64-bit range")


# -- rows as the store binds them: tuples in COLUMNS order, JSON columns already text -------------

_EMPTY: dict[str, Any] = {}
_JSON_COLUMNS = {table: frozenset(c for c, t in cols if t == "json") for table, cols in COLUMNS.items()}
_NUMERIC = frozenset({int, float, bool})
_STEP_FIELDS = STEP_ATTRS  # a step span's attrs, in the order of its row's phase columns


def json_texts(values: list[Any]) -> list[str]:
    """The JSON text of each value, from one encoder call: JSON Lines never holds a raw newline
    inside a value, so splitting on newlines gives back one text per value. Raises ValueError
    for a value that does not encode."""
    if not values:
        return []
    try:
        texts = _json.encode_lines(values).decode().split("\n")
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"not encodable as JSON ({exc})") from None
    texts.pop()  # the empty string after the last newline
    return texts


def row_tuples(table: str, rows: list[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """Dict rows (as ``check_rows`` passed them) as tuples in COLUMNS order; a missing key is
    NULL, a JSON column is its JSON text (None stays NULL). Column at a time, like check_rows."""
    columns = []
    for name, kind in COLUMNS[table]:
        values = [row.get(name) for row in rows]
        if kind == "json":
            values = [None if v is None else t for v, t in zip(values, json_texts(values))]
        columns.append(values)
    return list(zip(*columns))


def _check_step_values(rows: list[tuple[Any, ...]]) -> None:
    """The phase times of step rows come from span attrs, which no wire type constrains."""
    values = [v for row in rows for v in row[5:]]
    kinds = set(map(type, values))
    if not kinds <= _ALLOWED["int"]:
        raise ValueError("steps: a phase time that is not a number")
    if int in kinds:
        ints = [v for v in values if type(v) is int]
        if min(ints) < _INT64_MIN or max(ints) > _INT64_MAX:
            raise ValueError("steps: a phase time outside the 64-bit range")


_json_decoder = msgspec.json.Decoder()


def _json_values(texts: list[str]) -> list[Any]:
    """The values of JSON texts already checked to be one object each (``json_objects``)."""
    return _json_decoder.decode("[" + ",".join(texts) + "]")  # type: ignore[no-any-return]


def _span_steps(session_id: str, rank: int, views: list[SpanView], out: dict[str, list[tuple[Any, ...]]],
                carry: PhaseCarry | None, update: CarryUpdate | None) -> None:
    """The step rows of one frame's spans (their attrs' breakdown, or the span tree), into ``out``."""
    steps = [
        (session_id, rank, -1 if index is None else index, start, end, attrs["step_ns"],
         *[attrs.get(k, 0) for k in _STEP_FIELDS])
        for _id, _parent, name, index, start, end, attrs in views
        if name == "step" and attrs and "step_ns" in attrs
    ]
    if steps and update is not None:
        update.native = (session_id, rank)
    if len(steps) < sum(1 for v in views if v[2] == "step") or (carry is not None and carry.wants(session_id, rank)):
        steps += derive_steps(session_id, rank, views, carry, update)
    if steps:
        _check_step_values(steps)
        out["steps"] = steps


def _wire_telemetry_function() -> Any:
    """``tuples(events, metadata)``: the store tuples of typed wire telemetry rows, their columns
    read from the declaration (``schema.tables``) and written out once as one comprehension:
    building each tuple through ``attrgetter`` and unpacking it cost this path ~23% more."""
    getters = ", ".join(f"e.{field}" for field in fields("telemetry")[:-1])  # all but the metadata
    source = f"def tuples(events, metadata):\n    return [({getters}, m) for e, m in zip(events, metadata)]\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<stepwatch.store.rows telemetry>", "exec"), namespace)
    return namespace["tuples"]


_wire_telemetry = _wire_telemetry_function()


def wire_tuples(session_id: str, rank: int, tables: WireTables, carry: PhaseCarry | None = None,
                update: CarryUpdate | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """Store tuples straight from the typed wire rows of one frame (``decode_typed``): the same
    rows ``to_rows`` + ``check_rows`` + ``row_tuples`` give for that frame, without building a
    dict per row. Raises (ValueError, TypeError, KeyError...) where a value needs the general
    path's checks; the caller then takes that path, which stores or refuses it as before."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    telemetry = tables.telemetry
    if isinstance(telemetry, list):
        if telemetry:
            metadata = json_texts([e.metadata or _EMPTY for e in telemetry])
            out["telemetry"] = _wire_telemetry(telemetry, metadata)
    elif telemetry.rows:
        out["telemetry"] = telemetry.rows  # columnar: decoded as the store's tuples, checked by decode_typed
    spans = tables.spans
    if isinstance(spans, list):
        if spans:
            attrs = json_texts([s.attrs or _EMPTY for s in spans])
            out["spans"] = [
                (session_id, rank, s.id, s.parent_id, s.name, s.index, s.start_ns, s.end_ns, s.gpu_ns, s.thread_id,
                 s.pid, a)
                for s, a in zip(spans, attrs)
            ]
            views = [(s.id, s.parent_id, s.name, s.index, s.start_ns, s.end_ns, s.attrs) for s in spans]
            _span_steps(session_id, rank, views, out, carry, update)
    elif spans.rows:
        prefix = (session_id, rank)
        out["spans"] = [prefix + row for row in spans.rows]
        # the step spans' attrs as values; all spans' where steps may need their children (a bare
        # step, or a sender not yet seen sending steps with their breakdown)
        wanted = [row for row in spans.rows if row[2] == "step"]
        values = _json_values([row[9] for row in wanted])
        if (carry is not None and carry.wants(session_id, rank)) or not all(v and "step_ns" in v for v in values):
            wanted = spans.rows
            values = _json_values([row[9] for row in wanted])
        if wanted:
            views = [(r[0], r[1], r[2], r[3], r[4], r[5], v) for r, v in zip(wanted, values)]
            _span_steps(session_id, rank, views, out, carry, update)
    marks = tables.marks
    if isinstance(marks, list):
        if marks:
            attrs = json_texts([m.attrs or _EMPTY for m in marks])
            out["marks"] = [
                (session_id, rank, m.id, m.span_id, m.name, m.value_type,
                 float(m.value) if type(m.value) in _NUMERIC else None,
                 m.value if type(m.value) is str else m.value_nonfinite, m.ts_ns, m.kind, a)
                for m, a in zip(marks, attrs)
            ]
    elif marks.rows:
        out["marks"] = [
            (session_id, rank, mid, span_id, name, value_type, float(value) if type(value) in _NUMERIC else None,
             value if type(value) is str else nonfinite, ts_ns, kind, a)
            for mid, span_id, name, value_type, value, nonfinite, ts_ns, kind, a in marks.rows
        ]
    if tables.snapshots:
        rows = [snapshot_row(s, session_id, rank) for s in tables.snapshots]
        check_rows("snapshots", rows)
        out["snapshots"] = row_tuples("snapshots", rows)
    if tables.heartbeat:
        rows = [heartbeat_row(h, session_id) for h in tables.heartbeat]
        check_rows("heartbeats", rows)
        out["heartbeats"] = row_tuples("heartbeats", rows)
    return out
