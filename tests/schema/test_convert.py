"""Conversion of v4, v3, v2 and legacy records into canonical v3 events.

Specs: telemetry-event-v3.md ("Legacy compatibility"), telemetry-current-practice.md
("Reading v4 into v3", "Its reader's behaviour").
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.errors import UnsupportedSchemaVersion, ValidationError
from stepwatch.schema import (
    DEFAULT_LEGACY_COLLECTOR,
    TelemetryEventV3,
    json_schema,
    telemetry_event_from_record,
    telemetry_event_to_dict,
    validate_telemetry_record,
)
from tests.schema.test_records import (
    V2_REQUIRED,
    V3_FIELDS,
    V3_OPTIONAL,
    V4_CAPABILITY_OF,
    identity,
    json_objects,
    json_scalars,
    json_text,
    json_values,
    make_capabilities,
    make_v2_record,
    make_v4_record,
    non_empty_text,
    v2_records,
    v3_rank_breaks,
    v3_records,
    v3_single_field_breaks,
    v4_records,
)
from tests.support import examples
from tests.support.records import make_event, make_record

V3_VALIDATOR = jsonschema.Draft202012Validator(json_schema(3))
V3_REQUIRED_COUNTERS = (
    "allocator_allocated_bytes", "allocator_reserved_bytes", "allocator_change_bytes", "device_used_bytes",
)
V3_DEFAULTS = {"job_id": None, "rank": 0, "local_rank": 0, "world_size": 1}


def convert(record: Any, **kwargs: Any) -> TelemetryEventV3:
    event = telemetry_event_from_record(record, **kwargs)
    assert type(event) is TelemetryEventV3
    return event


def fails(record: Any, field: str | None = None, **kwargs: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        telemetry_event_from_record(record, **kwargs)
    if field is not None:
        assert info.value.field == field, f"expected {field}, got {info.value.field} ({info.value.rule})"
    return info.value


# --------------------------------------------------------------------------------------------
# legacy defaults


def test_minimal_legacy_record_gets_every_default() -> None:
    event = convert({"timestamp": 1.5})
    assert event.schema_version == 3
    assert event.timestamp_ns == 1_500_000_000
    assert event.pid == -1
    assert event.host == "unknown"
    assert event.device_id == -1
    assert event.event_type == "sample"
    assert event.collector == DEFAULT_LEGACY_COLLECTOR
    assert event.sampling_interval_ms == 0
    assert event.allocator_reserved_bytes == event.allocator_allocated_bytes
    assert event.device_used_bytes == event.allocator_allocated_bytes
    assert event.allocator_change_bytes == 0
    assert event.allocator_active_bytes is None
    assert event.allocator_inactive_bytes is None
    assert event.device_total_bytes is None
    assert event.device_free_bytes is None
    assert event.context is None
    assert event.metadata == {}
    assert (event.job_id, event.rank, event.local_rank, event.world_size) == (None, 0, 0, 1)
    assert isinstance(event.session_id, str) and event.session_id


def test_legacy_reserved_and_used_default_to_allocated() -> None:
    event = convert({"timestamp": 1, "allocator_allocated_bytes": 5000})
    assert (event.allocator_allocated_bytes, event.allocator_reserved_bytes, event.device_used_bytes) == (
        5000, 5000, 5000,
    )


def test_legacy_present_values_are_kept() -> None:
    record = {
        "timestamp_ns": 42,
        "pid": 77,
        "host": "node-9",
        "device_id": 3,
        "collector": "old.tracker",
        "sampling_interval_ms": 250,
        "allocator_allocated_bytes": 10,
        "allocator_reserved_bytes": 20,
        "allocator_active_bytes": 5,
        "allocator_inactive_bytes": 6,
        "allocator_change_bytes": -4,
        "device_used_bytes": 30,
        "device_free_bytes": 70,
        "device_total_bytes": 100,
        "event_type": "checkpoint",
        "context": "epoch 2",
        "metadata": {"backend": "cuda"},
        "session_id": "abc",
        "job_id": "j1",
        "rank": 1,
        "local_rank": 1,
        "world_size": 2,
    }
    event = convert(record)
    for name, value in record.items():
        if name != "timestamp_ns":
            assert getattr(event, name) == value, name
    assert event.timestamp_ns == 42


@pytest.mark.parametrize(
    ("device", "device_id"),
    [("cuda:1", 1), ("cuda:0", 0), ("CUDA:7", 7), ("cpu", -1), ("cpu:0", -1),
     ("tpu", -1), ("", -1), ("weird device", -1), (None, -1), ([1], -1), ("tpu:x", -1)],
)
def test_legacy_device_id_is_inferred_from_device(device: Any, device_id: int) -> None:
    assert convert({"timestamp": 1, "device": device}).device_id == device_id


@pytest.mark.parametrize("device", ["cuda:²", "gpu:٣", "cuda:x", "cuda:-1", "cuda:1.5"])
def test_legacy_device_with_an_odd_index_still_converts(device: str) -> None:
    """`'²'.isdigit()` is true but `int('²')` fails: such an index must not crash conversion."""
    assert convert({"timestamp": 1, "device": device}).device_id in (0, -1)


def test_legacy_device_id_wins_over_device() -> None:
    assert convert({"timestamp": 1, "device": "cuda:1", "device_id": 4}).device_id == 4


def test_legacy_device_id_missing_is_minus_one() -> None:
    assert convert({"timestamp": 1}).device_id == -1


@pytest.mark.parametrize(
    ("fields", "event_type"),
    [({"type": "checkpoint"}, "checkpoint"), ({}, "sample"),
     ({"event_type": "oom", "type": "checkpoint"}, "oom")],
)
def test_legacy_event_type(fields: dict[str, Any], event_type: str) -> None:
    assert convert({"timestamp": 1, **fields}).event_type == event_type


def test_legacy_metadata_fields_are_folded_into_metadata() -> None:
    event = convert(
        {"timestamp": 1, "metadata": {"backend": "cuda"}, "metadata_step": 3, "metadata_phase": "fwd"}
    )
    assert event.metadata == {"backend": "cuda", "step": 3, "phase": "fwd"}
    assert convert({"timestamp": 1, "metadata_step": [1, 2]}).metadata == {"step": [1, 2]}


@pytest.mark.parametrize("metadata", [[], "x", 3, True])
def test_legacy_metadata_must_be_an_object(metadata: Any) -> None:
    fails({"timestamp": 1, "metadata": metadata}, "$.metadata")


def test_legacy_collector_and_interval_defaults_are_honoured() -> None:
    event = convert({"timestamp": 1}, default_collector="my.collector", default_sampling_interval_ms=125)
    assert (event.collector, event.sampling_interval_ms) == ("my.collector", 125)


# --------------------------------------------------------------------------------------------
# synthetic session ids


def test_synthetic_session_id_is_deterministic() -> None:
    record = {"timestamp": 1, "host": "node-1", "pid": 9}
    assert convert(record).session_id == convert(dict(record)).session_id
    # records of one legacy capture (same host and process) land in one session
    assert convert({**record, "timestamp": 2}).session_id == convert(record).session_id
    assert convert({**record, "host": "node-2"}).session_id != convert(record).session_id


def test_v3_record_without_session_id_gets_a_deterministic_synthetic_id() -> None:
    record = make_record()
    del record["session_id"]
    first = convert(record)
    assert first.session_id and first.session_id == convert(dict(record)).session_id
    assert {**telemetry_event_to_dict(first), "session_id": None} == {**make_record(), "session_id": None}


@pytest.mark.parametrize(
    "record",
    [{"timestamp": 1}, make_v2_record(), {k: v for k, v in make_record().items() if k != "session_id"}],
    ids=["legacy", "v2", "v3-without-session"],
)
def test_default_session_id_is_honoured(record: dict[str, Any]) -> None:
    assert convert(record, default_session_id="sess-1").session_id == "sess-1"


def test_default_session_id_does_not_replace_a_present_one() -> None:
    assert convert(make_record(session_id="mine"), default_session_id="other").session_id == "mine"
    assert convert({"timestamp": 1, "session_id": "mine"}, default_session_id="other").session_id == "mine"


# --------------------------------------------------------------------------------------------
# timestamps


def test_timestamp_seconds_become_nanoseconds() -> None:
    assert convert({"timestamp": 2}).timestamp_ns == 2_000_000_000
    assert convert({"timestamp": 0}).timestamp_ns == 0
    assert convert({"timestamp": 1.5}).timestamp_ns == 1_500_000_000
    assert abs(convert({"timestamp": 1_700_000_000.25}).timestamp_ns - 1_700_000_000_250_000_000) < 1000


def test_timestamp_ns_wins_over_timestamp() -> None:
    assert convert({"timestamp_ns": 123, "timestamp": 99.0}).timestamp_ns == 123


@pytest.mark.parametrize(
    "record",
    [{}, {"host": "a"}, {"timestamp": None}, {"timestamp": "1700000000"}, {"timestamp": -1},
     {"timestamp": -0.5}, {"timestamp": float("nan")}, {"timestamp": float("inf")}, {"timestamp": True},
     {"timestamp": [1]}, {"timestamp": 1e300}, {"timestamp": -1e300}],
)
def test_legacy_record_without_valid_timestamp_fails(record: dict[str, Any]) -> None:
    fails(record)


def test_huge_integer_timestamp_seconds_convert_exactly() -> None:
    assert convert({"timestamp": 10**400}).timestamp_ns == 10**409


@pytest.mark.parametrize("value", [-1, 1.5, 1.0, "1", None, True])
def test_legacy_invalid_timestamp_ns_fails_naming_it(value: Any) -> None:
    fails({"timestamp_ns": value, "timestamp": 1.0}, "$.timestamp_ns")


# --------------------------------------------------------------------------------------------
# schema_version handling


def test_permissive_legacy_false_rejects_unversioned_records() -> None:
    fails({"timestamp": 1}, "$.schema_version", permissive_legacy=False)
    record = make_record()
    del record["schema_version"]
    fails(record, "$.schema_version", permissive_legacy=False)
    # versioned records are unaffected
    assert convert(make_record(), permissive_legacy=False) == validate_telemetry_record(make_record())


@pytest.mark.parametrize("version", ["3", 5, 1, 0, True, False, 3.0, 2.0, None, "", [3], {"v": 3}])
@pytest.mark.parametrize("permissive", [True, False])
def test_unsupported_schema_version_never_falls_back_to_legacy(version: Any, permissive: bool) -> None:
    """The record would convert fine as legacy; a present version is never guessed at."""
    for record in (make_record(schema_version=version), {"schema_version": version, "timestamp": 1.0}):
        with pytest.raises(UnsupportedSchemaVersion) as info:
            telemetry_event_from_record(record, permissive_legacy=permissive)
        assert info.value.field == "$.schema_version"


def test_invalid_v3_record_is_not_repaired() -> None:
    fails(make_record(rank=3), "$.rank")
    fails(make_record(pid=1.0), "$.pid")
    fails(make_record(bogus=1), "$.bogus")
    record = make_record()
    del record["host"]
    fails(record, "$.host")


# --------------------------------------------------------------------------------------------
# v2 -> v3


def test_v2_record_becomes_v3_with_session_and_identity_defaults() -> None:
    record = make_v2_record(context="ctx", metadata={"backend": "cuda", "n": 1}, device_total_bytes=10**9)
    event = convert(record)
    assert event.schema_version == 3
    for name in V2_REQUIRED:
        if name != "schema_version":
            assert getattr(event, name) == record[name], name
    assert {name: getattr(event, name) for name in V3_OPTIONAL} == V3_DEFAULTS
    assert event.session_id and event.session_id == convert(dict(record)).session_id


def test_v2_record_with_the_published_identity_fields_keeps_them() -> None:
    # the v2 JSON Schema its owners publish lists them as optional; real distributed exports carry them
    identity = {"job_id": "job-7", "rank": 3, "local_rank": 1, "world_size": 4}
    event = convert(make_v2_record(**identity))
    assert event.schema_version == 3
    assert {name: getattr(event, name) for name in V3_OPTIONAL} == identity
    assert validate_telemetry_record(make_v2_record(rank=0, job_id=None)).rank == 0


def test_invalid_v2_record_fails() -> None:
    fails(make_v2_record(rank=-1), "$.rank")
    fails(make_v2_record(local_rank=1.0), "$.local_rank")
    fails(make_v2_record(world_size=0), "$.world_size")
    fails(make_v2_record(job_id=""), "$.job_id")  # minLength 1, as published
    fails(make_v2_record(rank=2, world_size=2), "$.rank")  # < world_size, as v3
    fails(make_v2_record(local_rank=1), "$.local_rank")  # world_size defaults to 1
    fails(make_v2_record(session_id="s"), "$.session_id")  # still no session in v2
    fails(make_v2_record(allocator_allocated_bytes=None), "$.allocator_allocated_bytes")


# --------------------------------------------------------------------------------------------
# v4 -> v3


def test_v4_record_with_the_v3_counters_is_kept() -> None:
    record = make_v4_record(allocator_active_bytes=None, device_free_bytes=None, rank=1, world_size=2)
    event = convert(record)
    assert event.schema_version == 3
    for name, value in record.items():
        if name != "schema_version":
            assert getattr(event, name) == value, name
    assert event.metadata["memory_capabilities"] == make_capabilities()


@pytest.mark.parametrize("counter", V3_REQUIRED_COUNTERS)
@pytest.mark.parametrize("supported", [True, False])
def test_v4_record_with_a_null_v3_counter_is_refused_not_zero_filled(counter: str, supported: bool) -> None:
    capability = V4_CAPABILITY_OF[counter]
    nulls = {c: None for c, cap in V4_CAPABILITY_OF.items() if cap == capability}
    if supported:
        nulls = {counter: None}
    record = make_v4_record(metadata={"memory_capabilities": make_capabilities(**{capability: supported})}, **nulls)
    validate_telemetry_record(record)  # a valid v4 record ...
    error = fails(record)  # ... that cannot become v3
    assert error.field in {f"$.{name}" for name in nulls}
    assert "null" in error.rule


def test_invalid_v4_record_fails_before_narrowing() -> None:
    fails(make_v4_record(device_used_bytes=10**9), "$.device_used_bytes")
    fails(make_v4_record(metadata={}), "$.metadata.memory_capabilities")
    fails(make_v4_record(host=" "), "$.host")


# --------------------------------------------------------------------------------------------
# to_dict


def test_to_dict_has_every_field_nulls_included_and_round_trips(session_id: str) -> None:
    event = make_event(session_id, 7, job_id="j", rank=2, local_rank=0, world_size=4)
    data = telemetry_event_to_dict(event)
    assert set(data) == set(V3_FIELDS)
    assert data["device_total_bytes"] is None and data["context"] is None
    assert telemetry_event_from_record(data) == event
    assert json.loads(json.dumps(data)) == data


# --------------------------------------------------------------------------------------------
# properties


@given(v3_records())
def test_any_valid_v3_record_round_trips(record: dict[str, Any]) -> None:
    event = convert(record)
    assert validate_telemetry_record(record) == event
    data = telemetry_event_to_dict(event)
    assert data == {**V3_DEFAULTS, **record}
    assert telemetry_event_from_record(data) == event
    encoded = msgspec.json.encode(event)
    assert msgspec.json.decode(encoded, type=TelemetryEventV3) == event
    assert telemetry_event_from_record(msgspec.json.decode(encoded)) == event
    assert telemetry_event_from_record(json.loads(encoded)) == event


@given(v2_records())
def test_any_valid_v2_record_converts(record: dict[str, Any]) -> None:
    data = telemetry_event_to_dict(convert(record, default_session_id="s"))
    assert data == {**V3_DEFAULTS, **record, "schema_version": 3, "session_id": "s"}


@given(v4_records())
def test_any_valid_v4_record_converts_or_is_refused_for_a_null_v3_counter(record: dict[str, Any]) -> None:
    validate_telemetry_record(record)
    null_required = [c for c in V3_REQUIRED_COUNTERS if record[c] is None]
    if null_required:
        error = fails(record)
        assert error.field in {f"$.{c}" for c in null_required}
    else:
        data = telemetry_event_to_dict(convert(record))
        assert data == {**V3_DEFAULTS, **record, "schema_version": 3}
        V3_VALIDATOR.validate(data)


@given(v3_single_field_breaks())
def test_a_record_breaking_one_rule_is_rejected_naming_the_field(broken: tuple[dict[str, Any], str]) -> None:
    record, field = broken
    with pytest.raises(ValidationError) as info:
        validate_telemetry_record(record)
    assert info.value.field == field
    if field == "$.session_id" and "session_id" not in record:
        return  # from_record gives a v3 record without a session a synthetic one (spec)
    with pytest.raises(ValidationError) as info:
        telemetry_event_from_record(record)
    assert info.value.field == field


@given(v3_rank_breaks())
def test_a_rank_not_below_world_size_is_rejected_naming_it(broken: tuple[dict[str, Any], str]) -> None:
    record, field = broken
    for function in (validate_telemetry_record, telemetry_event_from_record):
        with pytest.raises(ValidationError) as info:
            function(record)
        assert info.value.field == field


@given(v4_records(), st.sampled_from(sorted(V4_CAPABILITY_OF)), st.integers(min_value=0, max_value=2**40))
def test_v4_counter_without_capability_is_rejected_naming_it(
    record: dict[str, Any], counter: str, value: int
) -> None:
    capability = V4_CAPABILITY_OF[counter]
    caps = {**record["metadata"]["memory_capabilities"], capability: False}
    record = {**record, "metadata": {**record["metadata"], "memory_capabilities": caps}}
    for other, cap in V4_CAPABILITY_OF.items():
        if cap == capability:
            record[other] = None
    record[counter] = value
    record["device_total_bytes"] = None if counter != "device_total_bytes" else value
    with pytest.raises(ValidationError) as info:
        validate_telemetry_record(record)
    assert info.value.field == f"$.{counter}"


LEGACY_KEYS = (
    *V3_FIELDS, "timestamp", "device", "type", "message", "memory_allocated", "allocated_bytes",
    "memory_mb", "memory_reserved", "reserved_bytes", "memory_change", "free_memory", "total_memory",
    "backend", "metadata_x", "metadata_",
)


# Python's json module reads NaN and Infinity, so a reader meets them too; the edge values are
# drawn often on purpose (overflow when scaled, digits int() cannot read, huge ints).
edge_values = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), 1e300, -1e300, 1e-300, 10**400, -(10**400), 2**64,
     -1, 0, 1.0, "", " ", "\u00b2", "cuda:\u00b2", "cuda:1", None, True, False, [], {}]
)
fuzz_scalars = edge_values | json_scalars | st.floats() | st.integers()
fuzz_values = st.recursive(
    fuzz_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(json_text, children, max_size=4),
    max_leaves=12,
)


@st.composite
def record_shaped(draw: st.DrawFn) -> dict[str, Any]:
    """Dicts with record and legacy keys holding arbitrary JSON values, sometimes near-valid."""
    base = draw(
        st.sampled_from([{}, {"timestamp": 1.0}])
        | v3_records()
        | v4_records()
        | v2_records()
        | legacy_records()
        | st.dictionaries(st.sampled_from(LEGACY_KEYS), fuzz_values, max_size=8)
    )
    changes = draw(st.dictionaries(st.sampled_from(LEGACY_KEYS) | json_text, fuzz_values, max_size=3))
    record = {**base, **changes}
    for key in draw(st.lists(st.sampled_from(sorted(record) or ["x"]), max_size=2)):
        record.pop(key, None)
    return record


@settings(max_examples=examples(200))
@given(fuzz_values | record_shaped())
def test_arbitrary_json_either_converts_or_raises_validation_error(value: Any) -> None:
    for kwargs in ({}, {"permissive_legacy": False}):
        try:
            event = telemetry_event_from_record(value, **kwargs)
        except ValidationError:
            pass
        else:
            assert type(event) is TelemetryEventV3
            # whatever is accepted is canonical
            assert validate_telemetry_record(telemetry_event_to_dict(event)) == event
    try:
        event = validate_telemetry_record(value)
    except ValidationError:
        pass
    else:
        assert event.schema_version == value["schema_version"]


def _counter(low: int = 0) -> st.SearchStrategy[Any]:
    ints = st.integers(min_value=low, max_value=2**53)
    return ints | ints.map(float)  # legacy writers stored byte counts as floats


LEGACY_OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
    "pid": st.integers(min_value=-1, max_value=2**22),
    "host": non_empty_text,
    "device": st.sampled_from(["cuda:0", "cuda:3", "cpu", "mps", "rocm:1", "weird", ""]),
    "device_id": st.integers(min_value=-1, max_value=64),
    "collector": non_empty_text,
    "backend": st.sampled_from(["cuda", "cpu", "mps", "rocm", "tensorflow", "other"]),
    "sampling_interval_ms": st.integers(min_value=0, max_value=60_000),
    "allocator_allocated_bytes": _counter(),
    "memory_allocated": _counter(),
    "memory_mb": st.floats(min_value=0, max_value=1e6) | st.integers(min_value=0, max_value=10**6),
    "allocator_reserved_bytes": _counter(),
    "memory_reserved": _counter(),
    "allocator_active_bytes": st.none() | _counter(),
    "allocator_inactive_bytes": st.none() | _counter(),
    "allocator_change_bytes": _counter(-(2**53)),
    "memory_change": _counter(-(2**53)),
    "device_used_bytes": _counter(),
    "device_free_bytes": st.none() | _counter(),
    "free_memory": st.none() | _counter(),
    "device_total_bytes": st.none() | _counter(),
    "total_memory": st.none() | _counter(),
    "event_type": non_empty_text,
    "type": non_empty_text,
    "context": st.none() | json_text,
    "message": st.none() | json_text,
    "metadata": st.none() | json_objects,
    "metadata_step": json_values,
    "metadata_phase": json_scalars,
    "session_id": non_empty_text,
}


@st.composite
def legacy_records(draw: st.DrawFn) -> dict[str, Any]:
    timestamp = draw(
        st.fixed_dictionaries({"timestamp": st.floats(min_value=0, max_value=4e9)})
        | st.fixed_dictionaries({"timestamp": st.integers(min_value=0, max_value=4 * 10**9)})
        | st.fixed_dictionaries({"timestamp_ns": st.integers(min_value=0, max_value=2**64)})
    )
    optional = draw(st.fixed_dictionaries({}, optional=LEGACY_OPTIONAL))
    return {**timestamp, **optional, **draw(identity())}


@given(legacy_records())
def test_legacy_records_always_convert_to_valid_v3(record: dict[str, Any]) -> None:
    event = convert(record)
    data = telemetry_event_to_dict(event)
    V3_VALIDATOR.validate(data)
    assert validate_telemetry_record(data) == event
    assert json.loads(msgspec.json.encode(event)) == data

    if "timestamp_ns" in record:
        assert event.timestamp_ns == record["timestamp_ns"]
    else:
        assert abs(event.timestamp_ns - record["timestamp"] * 1e9) <= 1
    if "pid" not in record:
        assert event.pid == -1
    if "host" not in record:
        assert event.host == "unknown"
    if "device_id" not in record and "device" not in record:
        assert event.device_id == -1
    if "device_id" not in record and record.get("device") in ("cpu", "weird", ""):
        assert event.device_id == -1
    if not {"allocator_reserved_bytes", "memory_reserved"} & set(record):
        assert event.allocator_reserved_bytes == event.allocator_allocated_bytes
    if "device_used_bytes" not in record:
        assert event.device_used_bytes == event.allocator_allocated_bytes
    if not {"allocator_change_bytes", "memory_change"} & set(record):
        assert event.allocator_change_bytes == 0
    if not {"device_total_bytes", "total_memory"} & set(record):
        assert event.device_total_bytes is None
    if not {"device_free_bytes", "free_memory"} & set(record):
        assert event.device_free_bytes is None
    if "event_type" not in record:
        assert event.event_type == record.get("type", "sample")
    else:
        assert event.event_type == record["event_type"]
    for name, default in V3_DEFAULTS.items():
        assert getattr(event, name) == record.get(name, default)
    for key in ("metadata_step", "metadata_phase"):
        short = key[len("metadata_"):]
        if key in record and short not in (record.get("metadata") or {}):
            assert event.metadata[short] == record[key]
    for name in ("allocator_allocated_bytes", "allocator_reserved_bytes", "device_used_bytes"):
        if name in record:
            assert getattr(event, name) == record[name]
    if "session_id" in record:
        assert event.session_id == record["session_id"]
    else:
        assert event.session_id == convert(dict(record)).session_id


# Keys a legacy reader consults before it falls back to the next one (the first present wins).
LEGACY_ALIASES = (
    ("allocator_allocated_bytes", "memory_allocated", "allocated_bytes", "memory_mb"),
    ("allocator_reserved_bytes", "memory_reserved", "reserved_bytes"),
    ("allocator_change_bytes", "memory_change"),
    ("device_free_bytes", "free_memory"),
    ("device_total_bytes", "total_memory"),
    ("timestamp_ns", "timestamp"),
    ("device_id", "device"),
    ("event_type", "type"),
    ("context", "message"),
)


LEGACY_BASES = (
    {"timestamp": 1.5},
    {"timestamp_ns": 7, "allocator_allocated_bytes": 10, "device": "cuda:1", "metadata": {"a": 1}},
    {"timestamp": 2, "memory_mb": 1.5, "total_memory": 100, "free_memory": 50, "type": "t", "pid": 3,
     "host": "h", "rank": 1, "world_size": 2, "metadata_step": 1},
)


@pytest.mark.parametrize("key", LEGACY_KEYS)
@settings(max_examples=25)
@given(record=st.sampled_from(LEGACY_BASES), value=edge_values | fuzz_values)
def test_legacy_record_with_any_value_in_one_field_converts_or_raises_validation_error(
    key: str, record: dict[str, Any], value: Any
) -> None:
    """Each legacy key in turn holds an arbitrary value, with the keys read before it removed."""
    record = dict(record)
    for group in LEGACY_ALIASES:
        if key in group:
            for earlier in group[: group.index(key)]:
                record.pop(earlier, None)
    record.pop("schema_version", None)
    record[key] = value
    try:
        event = telemetry_event_from_record(record)
    except ValidationError:
        return
    V3_VALIDATOR.validate(telemetry_event_to_dict(event))
