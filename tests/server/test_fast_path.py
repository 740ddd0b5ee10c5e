"""The aggregator's typed fast path (``decode_typed`` + ``wire_tuples``, and its HTTP twin) must
store exactly the rows, and refuse exactly the frames, that the general path (``decode_body`` +
``to_rows`` + ``check_rows`` + ``row_tuples``) does: hypothesis feeds both the same bodies, with
values of every msgpack/JSON type in every field, and compares what each queued."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from stepwatch.errors import TransportError
from stepwatch.server.aggregator import Aggregator
from stepwatch.server.http_ingest import IngestApp, _Reject
from stepwatch.store.sqlite import SqliteStore
from stepwatch.transport.frames import COLUMNAR, WireTables, columnar_table, decode_body, decode_typed, encode_frame
from tests.support import examples

_I64 = 1 << 63
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-_I64, (1 << 64) - 1), st.floats(allow_nan=False),
    st.text(max_size=8), st.binary(max_size=4),
)
_any = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3),
    st.dictionaries(st.integers(0, 3), inner, max_size=2),
), max_leaves=6)
_ints = st.one_of(st.integers(-_I64, _I64 - 1), st.integers(0, 10**12))
_hex = st.text("0123456789abcdef", min_size=1, max_size=32)


def _field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value the typed path takes, now and then anything (the general path decides)."""
    return st.integers(0, 15).flatmap(lambda i: _any if i == 15 else good)


def _row(required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]) -> Any:
    """A wire row: its required keys, now and then one left out; optional keys present or not."""
    rows = st.fixed_dictionaries({k: _field(v) for k, v in required.items()},
                                 optional={k: _field(v) for k, v in optional.items()})
    drop = st.integers(0, 15).flatmap(lambda i: st.sampled_from(list(required)) if i == 15 else st.just(""))
    return st.tuples(rows, drop).map(lambda pair: {k: v for k, v in pair[0].items() if k != pair[1]})


_step_attrs = st.fixed_dictionaries({"step_ns": _field(_ints)}, optional={
    "data_load_ns": _field(_ints), "forward_ns": _field(_ints), "optimizer_step_ns": _field(_ints),
    "extra": _any,
})
_telemetry = _row(
    {"session_id": st.text(min_size=1, max_size=6), "timestamp_ns": _ints, "event_type": st.sampled_from(["sample", "stop"]),
     "collector": st.text(max_size=5), "device_id": st.integers(-1, 3), "allocator_allocated_bytes": _ints,
     "allocator_reserved_bytes": _ints},
    {"rank": st.integers(0, 8), "allocator_active_bytes": _ints, "device_used_bytes": _ints, "pid": _ints,
     "host": st.text(max_size=5), "context": st.none() | st.text(max_size=5), "metadata": _any,
     "schema_version": st.just(3)},
)
_span = _row(
    {"id": _hex, "name": st.sampled_from(["step", "forward", "backward"]), "start_ns": _ints, "end_ns": _ints},
    {"parent_id": st.none() | _hex, "index": st.none() | st.integers(0, 100), "gpu_ns": st.none() | _ints,
     "thread_id": _ints, "pid": _ints, "rank": st.integers(0, 8), "attrs": st.one_of(_step_attrs, _any),
     "mark_ids": st.lists(_hex, max_size=2)},
)
_mark = _row(
    {"id": _hex, "name": st.text(max_size=5)},
    {"span_id": st.none() | _hex, "value_type": st.sampled_from(["float", "int", "str"]), "value": _any,
     "value_nonfinite": st.sampled_from(["nan", "inf"]), "ts_ns": _ints, "kind": st.just("point"), "attrs": _any},
)
_heartbeat = _row({"ts": st.floats(0, 2e9)}, {"rank": st.integers(0, 4), "step": st.integers(0, 9),
                                               "msg": st.just("progress"), "loss": _any})
_snapshot = _row({"id": _hex}, {"span_id": _hex, "tensor_name": st.text(max_size=4), "stats": _any})
_tables = st.fixed_dictionaries({}, optional={
    "telemetry": st.lists(_telemetry, max_size=4), "spans": st.lists(_span, max_size=4),
    "marks": st.lists(_mark, max_size=4), "heartbeat": st.lists(_heartbeat, max_size=2),
    "snapshots": st.lists(_snapshot, max_size=2),
})
_meta = st.fixed_dictionaries({"session_id": _field(st.text(min_size=1, max_size=6))},
                              optional={"rank": _field(st.integers(0, 64)), "host": st.text(max_size=4),
                                        "started_ns": _ints, "world_size": st.integers(1, 8)})


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory):
    """Two real stores for the two paths (only their session upserts land there)."""
    tmp = tmp_path_factory.mktemp("fast-path")
    pair = SqliteStore(tmp / "general.sqlite"), SqliteStore(tmp / "fast.sqlite")
    yield pair
    for store in pair:
        store.close()


def _normal(pending: dict[str, list[tuple[Any, ...]]]) -> dict[str, list[tuple[Any, ...]]]:
    """Rows with -0.0 and 0.0 told apart (== would not), and no empty tables."""
    def key(v: Any) -> Any:
        return ("float", math.copysign(1.0, v), v) if type(v) is float else v
    return {t: [tuple(key(v) for v in row) for row in rows] for t, rows in pending.items() if rows}


def _outcome(aggregator: Aggregator, fn: Any) -> Any:
    try:
        fn()
    except TransportError as exc:
        return ("refused", exc.reason)
    return _normal(aggregator._pending)


_SETTINGS = settings(max_examples=examples(300), deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(meta=_meta, tables=_tables)
# an attrs or metadata that is no map is refused on both paths (the typed one hands it back)
@example(meta={"session_id": "0"}, tables={"marks": [{"id": "0", "name": "", "span_id": None, "attrs": True}]})
@example(meta={"session_id": "0"}, tables={"telemetry": [{"metadata": "text"}]})
def test_tcp_fast_path_queues_and_refuses_like_the_general_path(stores: tuple[SqliteStore, SqliteStore],
                                                                meta: dict[str, Any], tables: dict[str, Any]) -> None:
    try:
        body = encode_frame(meta, tables)[4:]
    except (OverflowError, TypeError, ValueError):
        return  # not encodable as msgpack: no sender can send it
    general, fast = Aggregator(stores[0]), Aggregator(stores[1])
    expected = _outcome(general, lambda: general.accept(decode_body(body)))
    got = _outcome(fast, lambda: fast.accept_body(body))
    assert got == expected
    typed = decode_typed(body)
    event("refused" if isinstance(expected, tuple) else "general path" if typed is None else "typed decode")
    assert fast.ranks == general.ranks and fast.rows_accepted == general.rows_accepted


def test_the_fast_path_takes_the_usual_frames() -> None:
    """A frame as the runtime sends it goes through ``decode_typed`` (not the fallback)."""
    meta = {"session_id": "s", "rank": 2, "host": "h", "pid": 1, "started_ns": 5}
    tables = {"telemetry": [{"session_id": "s", "timestamp_ns": 1, "event_type": "sample", "collector": "c",
                             "device_id": 0, "allocator_allocated_bytes": 1, "allocator_reserved_bytes": 2,
                             "metadata": {"backend": "cpu"}, "job_id": None}],
              "spans": [{"id": "a" * 32, "name": "step", "index": 3, "start_ns": 1, "end_ns": 9, "rank": 2,
                         "attrs": {"step_ns": 8, "forward_ns": 2.5}, "mark_ids": []}],
              "marks": [{"id": "b" * 32, "name": "loss", "value": 0.5, "attrs": {"step": 3}}],
              "heartbeat": [{"ts": 1.5, "rank": 2, "step": 3, "msg": "progress", "loss": 0.5}]}
    typed = decode_typed(encode_frame(meta, tables)[4:])
    assert typed is not None
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "h.sqlite")
        try:
            aggregator = Aggregator(store)
            assert aggregator.accept_wire(typed[0], "s", 2, typed[1], "tcp") == 5  # 4 wire rows + 1 step row
            assert aggregator._pending["steps"] == [("s", 2, 3, 1, 9, 8, 0, 0, 2.5, 0, 0, 0, 0)]
            assert aggregator._pending["marks"][0][6:8] == (0.5, None)
        finally:
            store.close()


@pytest.mark.parametrize("body", [
    encode_frame({"session_id": "s"}, {"bogus": []})[4:],                       # unknown table
    msgspec.msgpack.encode({"session_id": "s", "marks": [{"id": "x", "name": "n"}]}),  # legacy flat envelope
    encode_frame({"session_id": "s", "rank": -1}, {})[4:],                       # bad rank
    encode_frame({"session_id": "s"}, {"spans": [{"id": "x", "name": "n", "start_ns": 1.0, "end_ns": 2}]})[4:],
    b"\x00garbage",
])
def test_frames_the_typed_decoder_leaves_to_the_general_path(body: bytes) -> None:
    assert decode_typed(body) is None


_batch = st.fixed_dictionaries(
    {"schema_version": st.sampled_from([1, 1, 1, 2, True]),
     "batch_id": st.sampled_from(["0" * 32, "ab" * 16, "XYZ", 7]),
     "spans": st.lists(_span, max_size=3), "marks": st.lists(_mark, max_size=3)},
    optional={"snapshots": st.lists(_snapshot, max_size=2), "sdk_version": st.text(max_size=3)},
)


@_SETTINGS
@given(batch=_batch)
def test_http_fast_path_queues_and_refuses_like_the_general_path(stores: tuple[SqliteStore, SqliteStore],
                                                                 batch: dict[str, Any]) -> None:
    try:
        raw = msgspec.json.encode(batch)
    except (OverflowError, TypeError, ValueError):
        return  # no JSON for it
    general, fast = Aggregator(stores[0]), Aggregator(stores[1])
    meta = {"session_id": "http-s", "rank": 0}
    try:
        parsed = IngestApp._batch(raw)
    except _Reject:
        parsed = None
    expected: Any = "400"
    if parsed is not None:
        tables = {k: parsed.get(k, []) for k in ("spans", "marks", "snapshots")}
        expected = _outcome(general, lambda: general.accept_tables(meta, tables, "http"))
    typed = IngestApp._typed_batch(raw)
    event("typed" if typed is not None else "general 400" if parsed is None else "general")
    if typed is None:
        return  # the handler then takes exactly the general path above
    assert parsed is not None, "the typed path took a batch the general path refuses"
    assert typed.batch_id == parsed["batch_id"]
    tables_typed = WireTables(spans=typed.spans, marks=typed.marks, snapshots=typed.snapshots)
    try:
        accepted = fast.accept_wire(meta, "http-s", 0, tables_typed, "http")
    except TransportError as exc:  # out of the wire's bounds (schema/limits.py): refused as the general path does
        assert expected == ("refused", exc.reason)
        assert fast._pending == {}
        return
    if accepted is None:
        event("typed, handed back")
        assert fast._pending == {}
        return
    assert _normal(fast._pending) == expected


# -- columnar tables (what FrameSender ships): the same rows as the row maps they stand for ------

_json_text = msgspec.json.Encoder()


def _columnar(tables: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(row tables, columnar tables) that mean the same: telemetry, spans and marks with exactly
    the columns ``COLUMNAR`` names (a key a row lacks is None in both), the JSON field as the
    sender encodes it; None when a JSON field's text would not read back as the same text (a
    top-level inf encodes as null, {0: 1, "0": 2} as duplicate keys): a sender-side loss, not a
    path difference."""
    rows_out, cols_out = dict(tables), dict(tables)
    for name, fields in COLUMNAR.items():
        if name not in tables:
            continue
        full = [{c: r.get(c) for c in fields} for r in tables[name]]
        values = []
        for r in full:
            try:
                text = _json_text.encode(r[fields[-1]] or {}).decode()
            except (TypeError, ValueError, OverflowError):
                return None
            if _json_text.encode(msgspec.json.decode(text) or {}).decode() != text:
                return None
            values.append([*(r[c] for c in fields[:-1]), text])
        rows_out[name] = full
        cols_out[name] = {"columns": list(fields), "rows": values}
    return rows_out, cols_out


@_SETTINGS
@given(meta=_meta, tables=_tables)
# bytes attrs: base64 text in the columnar JSON, a string where a map belongs on both paths
@example(meta={"session_id": "0"}, tables={"spans": [{"id": "0", "name": "step", "start_ns": 0, "end_ns": 0,
                                                      "parent_id": None, "index": None, "attrs": b"\x00"}]})
def test_columnar_frames_queue_and_refuse_like_their_row_maps(stores: tuple[SqliteStore, SqliteStore],
                                                              meta: dict[str, Any], tables: dict[str, Any]) -> None:
    pair = _columnar(tables)
    if pair is None:
        event("JSON field not text-stable")
        return
    try:
        rows_body = encode_frame(meta, pair[0])[4:]
        cols_body = encode_frame(meta, pair[1])[4:]
    except (OverflowError, TypeError, ValueError):
        return
    by_rows, fast, general = Aggregator(stores[0]), Aggregator(stores[1]), Aggregator(stores[1])
    expected = _outcome(by_rows, lambda: by_rows.accept_body(rows_body))
    assert _outcome(fast, lambda: fast.accept_body(cols_body)) == expected
    assert _outcome(general, lambda: general.accept(decode_body(cols_body))) == expected
    event("refused" if isinstance(expected, tuple) else
          "general path" if decode_typed(cols_body) is None else "typed columnar decode")
    assert fast.ranks == by_rows.ranks and fast.rows_accepted == by_rows.rows_accepted


def test_the_sender_ships_the_runtime_rows_columnar() -> None:
    """``FrameSender``'s tables (the runtime's Structs) go columnar and take the typed path."""
    from stepwatch.capture.spans import SpoolMark, SpoolSpan

    spans = [SpoolSpan(id="a" * 32, name="step", parent_id=None, index=3, start_ns=1, end_ns=9, cpu_ns=None,
                       gpu_ns=None, memory_peak_bytes=None, thread_id=1, pid=2, rank=2,
                       attrs={"step_ns": 8, "forward_ns": 2}, mark_ids=[])]
    marks = [SpoolMark(id="b" * 32, span_id="a" * 32, name="loss", value_type="float", value=0.5,
                       attrs={"step": 3}, ts_ns=9, kind="point")]
    table = columnar_table("spans", spans)
    assert table is not None and table["columns"] == COLUMNAR["spans"]
    assert columnar_table("spans", [{"id": "x"}]) is None  # dict rows go as they are
    body = encode_frame({"session_id": "s", "rank": 2}, {"spans": table, "marks": columnar_table("marks", marks)})[4:]
    typed = decode_typed(body)
    assert typed is not None and not isinstance(typed[1].spans, list)
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "h.sqlite")
        try:
            aggregator = Aggregator(store)
            assert aggregator.accept_body(body) == 3
            assert aggregator._pending["steps"] == [("s", 2, 3, 1, 9, 8, 0, 0, 2, 0, 0, 0, 0)]
            assert aggregator._pending["spans"][0][-1] == '{"step_ns":8,"forward_ns":2}'
        finally:
            store.close()


_SPAN_ROW = ["a" * 32, None, "step", 1, 1, 9, None, 1, 2, "{}"]


@pytest.mark.parametrize(("table", "typed", "outcome"), [
    ({"columns": list(COLUMNAR["spans"]), "rows": [_SPAN_ROW]}, True, 1),
    ({"columns": list(COLUMNAR["spans"])[::-1], "rows": [_SPAN_ROW[::-1]]}, False, 1),  # other order: expanded
    ({"columns": list(COLUMNAR["spans"]), "rows": [_SPAN_ROW[:-1]]}, False, "bad_rows"),  # short row
    ({"columns": list(COLUMNAR["spans"]), "rows": [[*_SPAN_ROW[:-1], "{"]]}, False, "bad_rows"),  # not JSON
    ({"columns": list(COLUMNAR["spans"]), "rows": [[*_SPAN_ROW[:-1], {"a": 1}]]}, False, "bad_rows"),  # not text
    ({"columns": [1, 2], "rows": []}, False, "bad_rows"),
    ({"columns": ["id", "id"], "rows": [["x", "y"]]}, False, "bad_rows"),
    ({"columns": list(COLUMNAR["spans"]), "rows": [_SPAN_ROW], "extra": 1}, False, "bad_rows"),
    # texts that are JSON only together ("[1" + "2]" and "3,4") are not taken as three objects
    ({"columns": list(COLUMNAR["spans"]), "rows": [[*_SPAN_ROW[:-1], t] for t in ('{"a":[1', '2]}', '{},{}')]},
     False, "bad_rows"),
])
def test_hostile_columnar_tables(stores: tuple[SqliteStore, SqliteStore], table: dict[str, Any], typed: bool,
                                 outcome: Any) -> None:
    body = encode_frame({"session_id": "s"}, {"spans": table})[4:]
    assert (decode_typed(body) is not None) is typed
    aggregator = Aggregator(stores[1])
    try:
        got: Any = aggregator.accept_body(body) - 1  # minus the step row
    except TransportError as exc:
        got = exc.reason
    assert got == outcome
