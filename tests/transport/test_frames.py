"""Wire frames: encode/decode round trips, stream reassembly, and every way a frame is refused."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.errors import TransportError
from stepwatch.transport.frames import TABLE_NAMES, FrameDecoder, Message, decode_body, encode_frame
from tests.support import examples

META = {"session_id": "s-1", "rank": 3, "host": "node-a", "pid": 42, "seq": 7}
TABLES = {
    "telemetry": [{"timestamp_ns": 1, "allocated": 10}, {"timestamp_ns": 2, "allocated": 11}],
    "spans": [{"id": "a" * 32, "name": "step", "start_ns": 5, "end_ns": 9, "attrs": {"step_ns": 4}}],
    "marks": [{"id": "b" * 32, "name": "loss", "value": 0.5}],
    "heartbeat": [{"ts": 1.5, "rank": 3, "step": 1, "msg": "progress"}],
}


def body_of(frame: bytes) -> bytes:
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    return frame[4:]


def reason_of(body: bytes) -> str:
    with pytest.raises(TransportError) as info:
        decode_body(body)
    return info.value.reason


def test_round_trip_keeps_meta_and_every_table() -> None:
    frame = encode_frame(META, TABLES)
    message = decode_body(body_of(frame))
    assert isinstance(message, Message)
    assert message.meta == META
    assert message.tables == TABLES
    assert message.rows == 5


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=6))
def test_a_frame_encoded_in_a_kept_buffer_is_the_same_frame(sizes: list[int]) -> None:
    """The sender encodes each frame into one buffer it keeps; frames bigger and smaller than the
    last come out byte for byte as a fresh encode makes them, and outlive the next one."""
    buffer = bytearray()
    frames = []
    for size in sizes:
        tables = {**TABLES, "heartbeat": [{"ts": 1.5, "msg": "x" * size}]}
        frame = encode_frame(META, tables, buffer)
        assert frame == encode_frame(META, tables) and type(frame) is bytes
        frames.append((frame, tables))
    for frame, tables in frames:
        assert decode_body(body_of(frame)).tables == tables


def test_encode_accepts_structs_as_rows() -> None:
    class Row(msgspec.Struct):
        id: str
        name: str

    message = decode_body(body_of(encode_frame(META, {"marks": [Row("x", "loss")]})))
    assert message.tables == {"marks": [{"id": "x", "name": "loss"}]}


def test_empty_tables_are_a_valid_frame() -> None:
    message = decode_body(body_of(encode_frame(META, {})))
    assert message.tables == {} and message.rows == 0


def test_rank_defaults_to_zero_when_absent() -> None:
    message = decode_body(body_of(encode_frame({"session_id": "s"}, {"marks": []})))
    assert message.meta.get("rank", 0) == 0


FRAMES = [encode_frame({**META, "seq": i}, {"marks": [{"id": f"m{i}", "name": "loss", "value": i}] * (i + 1)})
          for i in range(3)]
STREAM = b"".join(FRAMES)


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_decoder_reassembles_a_stream_cut_at_any_byte(cut: int) -> None:
    decoder = FrameDecoder()
    bodies = decoder.feed(STREAM[:cut]) + decoder.feed(STREAM[cut:])
    assert bodies == [body_of(f) for f in FRAMES]
    assert decoder.pending_bytes == 0


def test_decoder_byte_by_byte() -> None:
    decoder = FrameDecoder()
    bodies: list[bytes] = []
    for i in range(len(STREAM)):
        got = decoder.feed(STREAM[i:i + 1])
        bodies += got
        # a body comes out exactly when its last byte arrives, never earlier
        assert len(bodies) == sum(1 for end in _frame_ends() if end <= i + 1)
    assert [decode_body(b).meta["seq"] for b in bodies] == [0, 1, 2]


def _frame_ends() -> list[int]:
    ends, total = [], 0
    for f in FRAMES:
        total += len(f)
        ends.append(total)
    return ends


def test_decoder_several_frames_in_one_chunk_and_a_partial_tail() -> None:
    decoder = FrameDecoder()
    bodies = decoder.feed(STREAM + FRAMES[0][:6])
    assert len(bodies) == 3
    assert decoder.pending_bytes == 6
    assert decoder.feed(FRAMES[0][6:]) == [body_of(FRAMES[0])]
    assert decoder.pending_bytes == 0


def test_zero_length_frame_comes_out_empty_and_is_then_rejected() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"\x00\x00\x00\x00") == [b""]
    assert reason_of(b"") == "not_msgpack"


def test_oversize_length_prefix_is_refused_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame=1024)
    with pytest.raises(TransportError) as info:
        decoder.feed((1025).to_bytes(4, "big") + b"\x80")
    assert info.value.reason == "oversize"
    # exactly at the limit is fine
    ok = FrameDecoder(max_frame=1024)
    assert ok.feed((1024).to_bytes(4, "big") + b"x" * 1024) == [b"x" * 1024]


def test_oversize_prefix_split_over_chunks() -> None:
    decoder = FrameDecoder(max_frame=100)
    assert decoder.feed(b"\xff\xff") == []
    with pytest.raises(TransportError) as info:
        decoder.feed(b"\xff\xff")
    assert info.value.reason == "oversize"


def test_legacy_flat_envelope_is_accepted() -> None:
    body = msgspec.msgpack.encode({"session_id": "legacy", "rank": 1, "host": "h", **TABLES})
    message = decode_body(body)
    assert message.meta == {"session_id": "legacy", "rank": 1, "host": "h"}
    assert message.tables == TABLES


def test_legacy_flat_envelope_with_a_tables_key() -> None:
    body = msgspec.msgpack.encode({"session_id": "legacy", "rank": 2, "tables": {"marks": TABLES["marks"]}})
    message = decode_body(body)
    assert message.meta == {"session_id": "legacy", "rank": 2}
    assert message.tables == {"marks": TABLES["marks"]}


def test_envelope_body_without_tables_key_is_the_tables() -> None:
    body = msgspec.msgpack.encode({"meta": META, "body": {"marks": TABLES["marks"]}})
    assert decode_body(body).tables == {"marks": TABLES["marks"]}


def enc(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


@pytest.mark.parametrize(("body", "reason"), [
    (b"\xc1", "not_msgpack"),                                  # reserved opcode
    (b"\x92\x01", "not_msgpack"),                              # truncated array
    (enc({"meta": META, "body": {}}) + b"\x00", "not_msgpack"),  # trailing bytes
    (b"\x81\x91\x01\x01\x01", "not_msgpack"),                  # unhashable key
    (b"\xa4\x00\x00\x00\x80", "not_msgpack"),                  # a str that is not UTF-8
    (enc([META, TABLES]), "bad_shape"),                        # not a map
    (enc("hello"), "bad_shape"),
    (enc(None), "bad_shape"),
    (enc({"meta": [1], "body": {}}), "bad_shape"),
    (enc({"meta": META, "body": [1]}), "bad_shape"),
    (enc({"meta": META, "body": {"tables": [1]}}), "bad_shape"),
    (enc({"meta": {"rank": 0}, "body": {"tables": {}}}), "bad_meta"),          # missing session_id
    (enc({"meta": {"session_id": "", "rank": 0}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"meta": {"session_id": 5, "rank": 0}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"meta": {"session_id": "s", "rank": -1}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"meta": {"session_id": "s", "rank": "0"}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"meta": {"session_id": "s", "rank": 1.0}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"meta": {"session_id": "s", "rank": True}, "body": {"tables": {}}}), "bad_meta"),
    (enc({"rank": 0, "marks": []}), "bad_meta"),                               # legacy, no session
    (enc({"meta": META, "body": {"tables": {"bogus": []}}}), "unknown_table"),
    (enc({"session_id": "s", "bogus": [{}]}), "unknown_table"),                 # legacy unknown table
    (enc({"meta": META, "body": {"tables": {"marks": {"id": 1}}}}), "bad_rows"),
    (enc({"meta": META, "body": {"tables": {"marks": [1, 2]}}}), "bad_rows"),
    (enc({"meta": META, "body": {"tables": {"spans": [{"id": "x"}, "row"]}}}), "bad_rows"),
])
def test_malformed_bodies_are_rejected_with_a_reason(body: bytes, reason: str) -> None:
    assert reason_of(body) == reason


def test_deeply_nested_body_is_rejected_not_crashing() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # an array nested 100k deep: msgspec raises RecursionError
    assert reason_of(deep) == "not_msgpack"
    # the same depth inside a row of an otherwise valid frame
    head = b"\x82\xa4meta" + enc(META) + b"\xa4body\x81\xa6tables\x81\xa5marks\x91\x81\xa1x"
    assert reason_of(head + b"\x91" * 100_000 + b"\xc0") == "not_msgpack"


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512), st.lists(st.integers(1, 64), max_size=8))
def test_fuzz_decoder_and_decode_body_only_give_messages_or_transport_errors(data: bytes, cuts: list[int]) -> None:
    decoder = FrameDecoder(max_frame=256)
    pieces, start = [], 0
    for cut in cuts:
        pieces.append(data[start:start + cut])
        start += cut
    pieces.append(data[start:])
    try:
        for piece in pieces:
            for body in decoder.feed(piece):
                try:
                    assert isinstance(decode_body(body), Message)
                except TransportError:
                    pass
    except TransportError as exc:
        assert exc.reason == "oversize"
    try:
        message = decode_body(data)
    except TransportError as exc:
        assert exc.reason in {"not_msgpack", "bad_shape", "bad_meta", "unknown_table", "bad_rows"}
    else:
        assert isinstance(message.meta["session_id"], str) and message.meta["session_id"]
        assert set(message.tables) <= TABLE_NAMES


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                     st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=12)
_keys = st.sampled_from(["meta", "body", "tables", "session_id", "rank", *sorted(TABLE_NAMES), "x"])


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6))
def test_fuzz_structured_bodies_only_give_messages_or_transport_errors(payload: dict) -> None:
    body = msgspec.msgpack.encode(payload)
    try:
        message = decode_body(body)
    except TransportError:
        return
    assert isinstance(message.meta["session_id"], str) and message.meta["session_id"]
    rank = message.meta.get("rank", 0)
    assert type(rank) is int and rank >= 0
    assert set(message.tables) <= TABLE_NAMES
    assert all(isinstance(r, dict) for rows in message.tables.values() for r in rows)
