"""Strict validation of TelemetryEvent v2, v3 and v4 records (`validate_telemetry_record`).

Specs: telemetry-event-v3.md ("Required fields", "Distributed identity fields"),
telemetry-event-v2.md (JSON schema definition), telemetry-current-practice.md (v4).

The record strategies and the single-rule mutation table at the bottom of this module are
shared with ``test_convert.py`` and ``test_json_schema.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import strategies as st

from stepwatch.errors import UnsupportedSchemaVersion, ValidationError
from stepwatch.schema import (
    TelemetryEventV2,
    TelemetryEventV3,
    TelemetryEventV4,
    validate_telemetry_record,
)
from tests.support.records import make_record

# --------------------------------------------------------------------------------------------
# field tables, written from the specs (not read back from the code under test)

V2_REQUIRED = (
    "schema_version", "timestamp_ns", "event_type", "collector", "sampling_interval_ms", "pid",
    "host", "device_id", "allocator_allocated_bytes", "allocator_reserved_bytes",
    "allocator_active_bytes", "allocator_inactive_bytes", "allocator_change_bytes",
    "device_used_bytes", "device_free_bytes", "device_total_bytes", "context", "metadata",
)
V3_REQUIRED = ("schema_version", "session_id") + V2_REQUIRED[1:]
V3_OPTIONAL = ("job_id", "rank", "local_rank", "world_size")
V3_FIELDS = V3_REQUIRED + V3_OPTIONAL
V4_REQUIRED = V3_REQUIRED

INTEGER_FIELDS_V3 = (
    "timestamp_ns", "sampling_interval_ms", "pid", "device_id", "allocator_allocated_bytes",
    "allocator_reserved_bytes", "allocator_active_bytes", "allocator_inactive_bytes",
    "allocator_change_bytes", "device_used_bytes", "device_free_bytes", "device_total_bytes",
    "rank", "local_rank", "world_size",
)
NON_NEGATIVE_BYTES = (
    "allocator_allocated_bytes", "allocator_reserved_bytes", "allocator_active_bytes",
    "allocator_inactive_bytes", "device_used_bytes", "device_free_bytes", "device_total_bytes",
)
NULLABLE_V3 = (
    "allocator_active_bytes", "allocator_inactive_bytes", "device_free_bytes",
    "device_total_bytes", "context", "job_id",
)
NON_NULLABLE_V3 = (
    "session_id", "timestamp_ns", "event_type", "collector", "sampling_interval_ms", "pid",
    "host", "device_id", "allocator_allocated_bytes", "allocator_reserved_bytes",
    "allocator_change_bytes", "device_used_bytes", "metadata", "rank", "local_rank", "world_size",
)
NON_EMPTY_STRINGS_V3 = ("session_id", "event_type", "collector", "host")
V4_COUNTERS = NON_NEGATIVE_BYTES + ("allocator_change_bytes",)
V4_CAPABILITY_OF = {
    "allocator_allocated_bytes": "supports_allocator_allocated",
    "allocator_change_bytes": "supports_allocator_allocated",
    "allocator_reserved_bytes": "supports_allocator_reserved",
    "allocator_active_bytes": "supports_allocator_active",
    "allocator_inactive_bytes": "supports_allocator_inactive",
    "device_used_bytes": "supports_device_used",
    "device_free_bytes": "supports_device_free",
    "device_total_bytes": "supports_device_total",
}
CAPABILITY_STRINGS = ("backend", "telemetry_collector", "sampling_source")
CAPABILITY_BOOLS = (
    "supports_allocator_allocated", "supports_allocator_reserved", "supports_allocator_active",
    "supports_allocator_inactive", "supports_device_used", "supports_device_free",
    "supports_device_total", "supports_native_allocator_history",
    "supports_fragmentation_analysis", "supports_allocator_attribution",
    "supports_bounded_profiling",
)


def make_capabilities(**overrides: Any) -> dict[str, Any]:
    caps: dict[str, Any] = {
        "backend": "cuda",
        "telemetry_collector": "stormlog.cuda_tracker",
        "sampling_source": "torch.cuda.memory_stats",
        **dict.fromkeys(CAPABILITY_BOOLS, True),
    }
    caps.update(overrides)
    return caps


def make_v4_record(**overrides: Any) -> dict[str, Any]:
    """A valid v4 record (every capability true, used/free <= total)."""
    record = make_record(
        schema_version=4,
        allocator_active_bytes=512,
        allocator_inactive_bytes=256,
        device_used_bytes=4096,
        device_free_bytes=4096,
        device_total_bytes=8192,
        metadata={"backend": "cuda", "memory_capabilities": make_capabilities()},
    )
    record.update(overrides)
    return record


def make_v2_record(**overrides: Any) -> dict[str, Any]:
    record = make_record(schema_version=2)
    for name in ("session_id",) + V3_OPTIONAL:
        del record[name]
    record.update(overrides)
    return record


MAKERS = {2: make_v2_record, 3: make_record, 4: make_v4_record}
# v2 as its owners publish it: v3's distributed identity, optional (telemetry-current-practice.md)
V2_FIELDS = V2_REQUIRED + V3_OPTIONAL


def per_version(fields: tuple[str, ...], versions: tuple[int, ...] = (2, 3, 4)) -> list[tuple[int, str]]:
    """(version, field) pairs, leaving out the v3 fields v2 does not have."""
    return [(v, f) for v in versions for f in fields if v != 2 or f in V2_FIELDS]
STRUCTS = {2: TelemetryEventV2, 3: TelemetryEventV3, 4: TelemetryEventV4}
REQUIRED = {2: V2_REQUIRED, 3: V3_REQUIRED, 4: V4_REQUIRED}


def rejects(record: Any, field: str | None = None) -> ValidationError:
    """Asserts ``record`` is rejected (naming ``field`` when given) and returns the error."""
    with pytest.raises(ValidationError) as info:
        validate_telemetry_record(record)
    error = info.value
    assert isinstance(error, ValueError)
    assert isinstance(error.rule, str) and error.rule
    if field is not None:
        assert error.field == field, f"expected {field}, got {error.field} ({error.rule})"
    return error


# --------------------------------------------------------------------------------------------
# valid records


@pytest.mark.parametrize("version", [2, 3, 4])
def test_valid_record_is_returned_as_its_struct(version: int) -> None:
    record = MAKERS[version]()
    event = validate_telemetry_record(record)
    assert type(event) is STRUCTS[version]
    assert event.schema_version == version
    for name, value in record.items():
        assert getattr(event, name) == value


def test_v3_optional_identity_fields_default_to_single_process() -> None:
    record = make_record()
    for name in V3_OPTIONAL:
        del record[name]
    event = validate_telemetry_record(record)
    assert (event.job_id, event.rank, event.local_rank, event.world_size) == (None, 0, 0, 1)


def test_v3_distributed_identity_accepted_at_the_bounds() -> None:
    event = validate_telemetry_record(make_record(job_id="job-7", rank=7, local_rank=3, world_size=8))
    assert (event.job_id, event.rank, event.local_rank, event.world_size) == ("job-7", 7, 3, 8)


# --------------------------------------------------------------------------------------------
# required and unknown fields


@pytest.mark.parametrize(
    ("version", "field"),
    [(v, f) for v in (2, 3, 4) for f in REQUIRED[v]],
)
def test_every_required_field_missing_is_rejected_by_name(version: int, field: str) -> None:
    record = MAKERS[version]()
    del record[field]
    error = rejects(record, f"$.{field}")
    assert "required" in error.rule


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("unknown", ["bogus", "timestamp", "metadata_backend", "Rank"])
def test_unknown_top_level_field_is_rejected_by_name(version: int, unknown: str) -> None:
    error = rejects(MAKERS[version](**{unknown: 1}), f"$.{unknown}")
    assert "unknown" in error.rule


def test_v2_rejects_the_v3_only_session_id() -> None:
    rejects(make_v2_record(session_id=make_record()["session_id"]), "$.session_id")


@pytest.mark.parametrize("field", V3_OPTIONAL)
def test_v2_accepts_the_published_optional_identity_fields(field: str) -> None:
    record = make_v2_record(**{field: make_record()[field]})
    assert getattr(validate_telemetry_record(record), field) == record[field]


@pytest.mark.parametrize("record", [None, [], "record", 3, [make_record()]])
def test_non_object_record_is_rejected(record: Any) -> None:
    rejects(record, "$")


# --------------------------------------------------------------------------------------------
# schema_version


@pytest.mark.parametrize("version", ["3", 5, 1, 0, -3, True, 3.0, None, [3], 2**70])
def test_unsupported_schema_version_is_rejected(version: Any) -> None:
    with pytest.raises(UnsupportedSchemaVersion) as info:
        validate_telemetry_record(make_record(schema_version=version))
    assert info.value.field == "$.schema_version"
    assert isinstance(info.value, ValidationError)


@pytest.mark.parametrize(("claimed", "maker"), [(2, make_record), (3, make_v2_record), (4, make_record)])
def test_record_is_checked_against_the_version_it_claims(claimed: int, maker: Any) -> None:
    """A v3 record that claims v2 has unknown fields; a v2 record that claims v3 lacks some."""
    with pytest.raises(ValidationError):
        validate_telemetry_record(maker(schema_version=claimed))


# --------------------------------------------------------------------------------------------
# metadata


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("metadata", [None, [], ["a", 1], "{}", 0, 1.5, True])
def test_metadata_must_be_an_object(version: int, metadata: Any) -> None:
    rejects(MAKERS[version](metadata=metadata), "$.metadata")


@pytest.mark.parametrize("metadata", [{}, {"nested": {"a": [1, None, 2.5]}, "flag": False}])
def test_metadata_any_object_is_accepted(metadata: dict[str, Any]) -> None:
    assert validate_telemetry_record(make_record(metadata=metadata)).metadata == metadata


# --------------------------------------------------------------------------------------------
# distributed identity


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("field", ["rank", "local_rank"])
@pytest.mark.parametrize("value", [-1, -(2**40)])
def test_rank_and_local_rank_must_be_non_negative(version: int, field: str, value: int) -> None:
    rejects(MAKERS[version](**{field: value}, world_size=4), f"$.{field}")


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("field", ["rank", "local_rank"])
@pytest.mark.parametrize(("value", "world_size"), [(1, 1), (4, 4), (5, 4), (2**40, 8)])
def test_rank_and_local_rank_must_be_below_world_size(
    version: int, field: str, value: int, world_size: int
) -> None:
    error = rejects(MAKERS[version](**{field: value}, world_size=world_size), f"$.{field}")
    assert "world_size" in error.rule


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("world_size", [0, -1, -8])
def test_world_size_must_be_at_least_one(version: int, world_size: int) -> None:
    rejects(MAKERS[version](world_size=world_size), "$.world_size")


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("job_id", [0, 1.5, [], {}, True])
def test_job_id_must_be_string_or_null(version: int, job_id: Any) -> None:
    rejects(MAKERS[version](job_id=job_id), "$.job_id")


# --------------------------------------------------------------------------------------------
# integer minimums


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize(
    ("field", "lowest"),
    [("timestamp_ns", 0), ("sampling_interval_ms", 0), ("pid", -1)]
    + [(name, 0) for name in NON_NEGATIVE_BYTES],
)
def test_integer_minimums(version: int, field: str, lowest: int) -> None:
    overrides: dict[str, Any] = {}
    if version == 4 and field == "device_total_bytes":
        overrides = {"device_used_bytes": 0, "device_free_bytes": 0}  # keep used/free <= total
    accepted = validate_telemetry_record(MAKERS[version](**{field: lowest}, **overrides))
    assert getattr(accepted, field) == lowest
    rejects(MAKERS[version](**{field: lowest - 1}, **overrides), f"$.{field}")
    rejects(MAKERS[version](**{field: -(2**63) - 1}, **overrides), f"$.{field}")


@pytest.mark.parametrize("version", [2, 3, 4])
@pytest.mark.parametrize("field", ["device_id", "allocator_change_bytes"])
@pytest.mark.parametrize("value", [-1, -(2**40), 2**40])
def test_signed_integer_fields_take_any_integer(version: int, field: str, value: int) -> None:
    assert getattr(validate_telemetry_record(MAKERS[version](**{field: value})), field) == value


def test_large_integers_are_kept_exactly() -> None:
    record = make_record(timestamp_ns=2**64 + 1, allocator_allocated_bytes=2**63, device_used_bytes=2**70)
    event = validate_telemetry_record(record)
    assert (event.timestamp_ns, event.allocator_allocated_bytes, event.device_used_bytes) == (
        2**64 + 1, 2**63, 2**70,
    )


# --------------------------------------------------------------------------------------------
# nullability


@pytest.mark.parametrize(("version", "field"), per_version(NULLABLE_V3, (2, 3)))
def test_nullable_fields_accept_null(version: int, field: str) -> None:
    assert getattr(validate_telemetry_record(MAKERS[version](**{field: None})), field) is None


@pytest.mark.parametrize(("version", "field"), per_version(NON_NULLABLE_V3, (2, 3)))
def test_non_nullable_fields_reject_null(version: int, field: str) -> None:
    rejects(MAKERS[version](**{field: None}), f"$.{field}")


def test_context_is_a_string_or_null() -> None:
    assert validate_telemetry_record(make_record(context="")).context == ""
    assert validate_telemetry_record(make_record(context="after step 3")).context == "after step 3"
    rejects(make_record(context=3), "$.context")
    rejects(make_record(context=["x"]), "$.context")


# --------------------------------------------------------------------------------------------
# types: integral floats, booleans and strings


@pytest.mark.parametrize(("version", "field"), per_version(INTEGER_FIELDS_V3))
@pytest.mark.parametrize("value", [1.0, 0.0, True, False, "1"])
def test_integer_fields_reject_floats_bools_and_strings(version: int, field: str, value: Any) -> None:
    rejects(MAKERS[version](**{field: value}), f"$.{field}")


def test_integer_written_with_exponent_is_rejected() -> None:
    """telemetry-current-practice.md: integers are written without decimal point or exponent."""
    text = json.dumps(make_record()).replace('"timestamp_ns": 1700000000000000000', '"timestamp_ns": 1.7e18')
    assert "1.7e18" in text
    rejects(json.loads(text), "$.timestamp_ns")
    text = json.dumps(make_record()).replace('"pid": 1234', '"pid": 1234.0')
    rejects(json.loads(text), "$.pid")


@pytest.mark.parametrize(("version", "field"), per_version(NON_EMPTY_STRINGS_V3))
@pytest.mark.parametrize("value", [1, True, None, ["x"], {"x": 1}, b"x"])
def test_string_fields_reject_other_types(version: int, field: str, value: Any) -> None:
    rejects(MAKERS[version](**{field: value}), f"$.{field}")


@pytest.mark.parametrize(("version", "field"), per_version(NON_EMPTY_STRINGS_V3))
def test_string_fields_must_not_be_empty(version: int, field: str) -> None:
    rejects(MAKERS[version](**{field: ""}), f"$.{field}")


# --------------------------------------------------------------------------------------------
# v4 (telemetry-current-practice.md)


@pytest.mark.parametrize("field", ["session_id", "event_type", "collector", "host"])
@pytest.mark.parametrize("value", [" ", "\t", "  \n ", "\u3000"])
def test_v4_strings_must_contain_a_non_space_character(field: str, value: str) -> None:
    rejects(make_v4_record(**{field: value}), f"$.{field}")
    assert getattr(validate_telemetry_record(make_v4_record(**{field: f" {field} "})), field) == f" {field} "


@pytest.mark.parametrize("metadata", [{}, {"backend": "cuda"}, {"memory_capabilities": None}])
def test_v4_memory_capabilities_is_required(metadata: dict[str, Any]) -> None:
    rejects(make_v4_record(metadata=metadata), "$.metadata.memory_capabilities")


@pytest.mark.parametrize("caps", [[], "cuda", 1, True])
def test_v4_memory_capabilities_must_be_an_object(caps: Any) -> None:
    rejects(make_v4_record(metadata={"memory_capabilities": caps}), "$.metadata.memory_capabilities")


@pytest.mark.parametrize("key", CAPABILITY_STRINGS + CAPABILITY_BOOLS)
def test_v4_memory_capabilities_every_key_is_required(key: str) -> None:
    caps = make_capabilities()
    del caps[key]
    rejects(make_v4_record(metadata={"memory_capabilities": caps}), f"$.metadata.memory_capabilities.{key}")


@pytest.mark.parametrize("key", ["supports_everything", "extra", "Backend"])
def test_v4_memory_capabilities_unknown_key_is_rejected(key: str) -> None:
    caps = make_capabilities(**{key: True})
    rejects(make_v4_record(metadata={"memory_capabilities": caps}), f"$.metadata.memory_capabilities.{key}")


@pytest.mark.parametrize("key", CAPABILITY_STRINGS)
@pytest.mark.parametrize("value", ["", " ", "\t\n", 1, None, True])
def test_v4_capability_strings_must_be_non_blank_strings(key: str, value: Any) -> None:
    caps = make_capabilities(**{key: value})
    rejects(make_v4_record(metadata={"memory_capabilities": caps}), f"$.metadata.memory_capabilities.{key}")


@pytest.mark.parametrize("key", CAPABILITY_BOOLS)
@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_v4_capability_flags_must_be_booleans(key: str, value: Any) -> None:
    caps = make_capabilities(**{key: value})
    rejects(make_v4_record(metadata={"memory_capabilities": caps}), f"$.metadata.memory_capabilities.{key}")


def test_v4_other_metadata_is_kept() -> None:
    metadata = {"memory_capabilities": make_capabilities(), "backend": "cuda", "step": 4}
    assert validate_telemetry_record(make_v4_record(metadata=metadata)).metadata == metadata


@pytest.mark.parametrize("counter", V4_COUNTERS)
def test_v4_counters_may_be_null(counter: str) -> None:
    event = validate_telemetry_record(make_v4_record(**{counter: None}))
    assert getattr(event, counter) is None


def test_v4_all_counters_null_with_no_capabilities() -> None:
    caps = make_capabilities(**dict.fromkeys(CAPABILITY_BOOLS, False))
    record = make_v4_record(metadata={"memory_capabilities": caps}, **dict.fromkeys(V4_COUNTERS))
    event = validate_telemetry_record(record)
    assert all(getattr(event, c) is None for c in V4_COUNTERS)


@pytest.mark.parametrize(("counter", "capability"), sorted(V4_CAPABILITY_OF.items()))
def test_v4_counter_must_be_null_when_its_capability_is_false(counter: str, capability: str) -> None:
    caps = make_capabilities(**{capability: False})
    # every counter sharing this capability null except the one under test
    nulls = {c: None for c, cap in V4_CAPABILITY_OF.items() if cap == capability and c != counter}
    record = make_v4_record(metadata={"memory_capabilities": caps}, **nulls)
    error = rejects(record, f"$.{counter}")
    assert capability in error.rule
    record[counter] = None
    assert getattr(validate_telemetry_record(record), counter) is None


@pytest.mark.parametrize("field", ["device_used_bytes", "device_free_bytes"])
def test_v4_used_and_free_must_not_exceed_total(field: str) -> None:
    assert getattr(validate_telemetry_record(make_v4_record(**{field: 8192})), field) == 8192
    error = rejects(make_v4_record(**{field: 8193}), f"$.{field}")
    assert "device_total_bytes" in error.rule
    # without a total there is nothing to compare against
    assert getattr(validate_telemetry_record(make_v4_record(**{field: 10**15}, device_total_bytes=None)), field)


@pytest.mark.parametrize("field", ["rank", "local_rank"])
def test_v4_rank_below_world_size(field: str) -> None:
    rejects(make_v4_record(**{field: 2}, world_size=2), f"$.{field}")


# --------------------------------------------------------------------------------------------
# Strategies shared with test_convert.py and test_json_schema.py

# JSON text cannot carry lone surrogates; everything else is fair game.
json_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
non_empty_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
# v4: at least one non-space character somewhere (matches the `\S` pattern of both validators).
word_text = st.builds(
    lambda head, core, tail: head + core + tail,
    st.sampled_from(["", " ", "\t"]),
    st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=8)
    .filter(lambda s: re.search(r"\S", s) is not None),
    st.sampled_from(["", " "]),
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(json_text, children, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(json_text, json_values, max_size=5)
non_negative = st.integers(min_value=0, max_value=2**64)
any_int = st.integers(min_value=-(2**64), max_value=2**64)


@st.composite
def identity(draw: st.DrawFn) -> dict[str, Any]:
    """Distributed identity respecting 0 <= rank, local_rank < world_size; any subset present."""
    world_size = draw(st.integers(min_value=1, max_value=4096))
    values = {
        "job_id": draw(st.none() | json_text),
        "rank": draw(st.integers(min_value=0, max_value=world_size - 1)),
        "local_rank": draw(st.integers(min_value=0, max_value=world_size - 1)),
        "world_size": world_size,
    }
    keep = draw(st.sets(st.sampled_from(V3_OPTIONAL)))
    if ("rank" in keep or "local_rank" in keep) and "world_size" not in keep:
        keep.discard("rank")  # without world_size the default 1 would make them >= world_size
        keep.discard("local_rank")
    return {name: values[name] for name in keep}


@st.composite
def v3_records(draw: st.DrawFn) -> dict[str, Any]:
    """Any valid v3 record (the optional identity fields present or not)."""
    record = {
        "schema_version": 3,
        "session_id": draw(non_empty_text),
        "timestamp_ns": draw(non_negative),
        "event_type": draw(non_empty_text),
        "collector": draw(non_empty_text),
        "sampling_interval_ms": draw(non_negative),
        "pid": draw(st.integers(min_value=-1, max_value=2**32)),
        "host": draw(non_empty_text),
        "device_id": draw(any_int),
        "allocator_allocated_bytes": draw(non_negative),
        "allocator_reserved_bytes": draw(non_negative),
        "allocator_active_bytes": draw(st.none() | non_negative),
        "allocator_inactive_bytes": draw(st.none() | non_negative),
        "allocator_change_bytes": draw(any_int),
        "device_used_bytes": draw(non_negative),
        "device_free_bytes": draw(st.none() | non_negative),
        "device_total_bytes": draw(st.none() | non_negative),
        "context": draw(st.none() | json_text),
        "metadata": draw(json_objects),
    }
    record.update(draw(identity()))
    return record


@st.composite
def v2_records(draw: st.DrawFn) -> dict[str, Any]:
    record = draw(v3_records())
    record.pop("session_id")
    for name in V3_OPTIONAL:
        if draw(st.booleans()):  # optional in v2 too: real distributed v2 exports carry them
            record.pop(name, None)
    if record.get("job_id") == "":  # v2 as published: job_id has minLength 1 (v3's has none)
        record["job_id"] = None
    if record.get("rank", 0) >= record.get("world_size", 1) or record.get("local_rank", 0) >= record.get("world_size", 1):
        record.pop("rank", None)
        record.pop("local_rank", None)
    record["schema_version"] = 2
    return record


@st.composite
def v4_records(draw: st.DrawFn) -> dict[str, Any]:
    """Any valid v4 record: capabilities drawn first, counters null where they must be."""
    caps = {name: draw(word_text) for name in CAPABILITY_STRINGS}
    caps.update({name: draw(st.booleans()) for name in CAPABILITY_BOOLS})
    record = draw(v3_records())
    record["schema_version"] = 4
    for name in ("session_id", "event_type", "collector", "host"):
        record[name] = draw(word_text)
    for counter, capability in V4_CAPABILITY_OF.items():
        # a counter whose capability is false must be null; a supported one may be null too
        if not caps[capability] or draw(st.booleans()):
            record[counter] = None
    total = record["device_total_bytes"]
    if total is not None:
        for name in ("device_used_bytes", "device_free_bytes"):
            if record[name] is not None:
                record[name] = draw(st.integers(min_value=0, max_value=total))
    record["metadata"] = {**record["metadata"], "memory_capabilities": caps}
    return record


def with_field(record: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    mutated = dict(record)
    if value is _DELETE:
        mutated.pop(field, None)
    else:
        mutated[field] = value
    return mutated


_DELETE = object()
NULL_BREAK = st.none()  # the "null where not nullable" entries of the table below
# keys that msgspec's error text cannot name unambiguously (`k` - at `$.x`) are left out
unknown_keys = json_text.filter(lambda k: k not in V3_FIELDS and " - at `$" not in k)

# One entry per single-field rule a JSON Schema can express: (field, strategy of a bad value).
# `_DELETE` removes the field. Cross-field rules (rank/local_rank < world_size) are separate.
SINGLE_FIELD_BREAKS_V3: list[tuple[str, st.SearchStrategy[Any]]] = (
    [(name, st.just(_DELETE)) for name in V3_REQUIRED if name != "schema_version"]
    + [(name, NULL_BREAK) for name in NON_NULLABLE_V3]
    + [(name, json_text | st.lists(st.integers(), max_size=2) | st.booleans())
       for name in INTEGER_FIELDS_V3]
    + [(name, st.integers(max_value=-1)) for name in
       ("timestamp_ns", "sampling_interval_ms", "rank", "local_rank") + NON_NEGATIVE_BYTES]
    + [("pid", st.integers(max_value=-2)), ("world_size", st.integers(max_value=0))]
    + [(name, st.just("")) for name in NON_EMPTY_STRINGS_V3]
    + [(name, st.integers() | st.booleans() | st.lists(json_text, max_size=2))
       for name in NON_EMPTY_STRINGS_V3 + ("context", "job_id")]
    + [("metadata", st.lists(json_scalars, max_size=3) | json_scalars.filter(lambda v: v is not None))]
    # unsupported versions only: 2 or 4 would be checked as that version and fail elsewhere
    + [("schema_version", st.sampled_from([5, 1, 0, -3, 2**70]) | json_text | st.none())]
)


@st.composite
def v3_single_field_breaks(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """(a v3 record breaking exactly one single-field rule, the JSON path of that field)."""
    record = draw(v3_records())
    if draw(st.integers(min_value=0, max_value=len(SINGLE_FIELD_BREAKS_V3))) == 0:
        key = draw(unknown_keys)
        return with_field(record, key, draw(json_values)), f"$.{key}"
    field, bad = draw(st.sampled_from(SINGLE_FIELD_BREAKS_V3))
    return with_field(record, field, draw(bad)), f"$.{field}"


@st.composite
def v3_rank_breaks(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A v3 record whose rank or local_rank is >= world_size (a Struct-only, cross-field rule)."""
    record = draw(v3_records())
    world_size = record.get("world_size", 1)
    field = draw(st.sampled_from(["rank", "local_rank"]))
    record[field] = draw(st.integers(min_value=world_size, max_value=world_size + 2**40))
    return record, f"$.{field}"
