"""``check_rows``: what the store refuses before a row is queued, naming the table and column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepwatch.errors import TransportError
from stepwatch.server.aggregator import Aggregator
from stepwatch.store.rows import check_rows
from stepwatch.store.sqlite import SqliteStore
from stepwatch.transport.frames import decode_body, encode_frame


@pytest.mark.parametrize(("table", "column"), [("spans", "attrs"), ("marks", "attrs"), ("telemetry", "metadata"),
                                               ("snapshots", "stats"), ("heartbeats", "fields")])
@pytest.mark.parametrize("value", ["text", 3, True, [1, 2]])
def test_an_object_column_holding_no_map_is_refused_naming_it(table: str, column: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{table}.{column}: a {type(value).__name__} where a map belongs"):
        check_rows(table, [{column: {"ok": 1}}, {column: value}])
    check_rows(table, [{column: {"ok": 1}}, {column: None}])  # a map, or nothing


@pytest.mark.parametrize("path", ["general", "fast"])
def test_a_frame_whose_span_attrs_is_a_string_is_refused_whole(tmp_path: Path, path: str) -> None:
    """Readers look names up in attrs: a string there (what a bytes value becomes in JSON) would
    fail every later reader, so the frame is refused at the door and nothing of it is queued."""
    store = SqliteStore(tmp_path / "history.sqlite")
    aggregator = Aggregator(store)
    good = {"id": "a", "name": "forward", "start_ns": 1, "end_ns": 2, "attrs": {"n": 1}}
    body = encode_frame({"session_id": "s"}, {"spans": [good, {**good, "id": "b", "attrs": "AA=="}]})[4:]
    with pytest.raises(TransportError) as refused:
        aggregator.accept_body(body) if path == "fast" else aggregator.accept(decode_body(body))
    assert refused.value.reason == "bad_rows" and "spans.attrs: a str where a map belongs" in str(refused.value)
    assert aggregator._pending == {} or not any(aggregator._pending.values())
    store.close()
