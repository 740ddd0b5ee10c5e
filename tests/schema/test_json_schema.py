"""The shipped JSON Schemas agree with the msgspec validation, and the sink writes records they accept.

What the JSON Schemas cannot say, and so only the Structs enforce (documented here by tests):
  * cross-field rules: ``rank`` and ``local_rank`` < ``world_size`` (v3, v4); in v4 a counter
    whose capability is false is null, and ``device_used_bytes`` / ``device_free_bytes`` <=
    ``device_total_bytes``;
  * integers written as integral floats (``1.0``): JSON Schema's ``integer`` type accepts any
    number with a zero fractional part, stepwatch (like Stormlog 0.4.3's reader) rejects them.
Every other rule is a single-field rule, and there both validators must agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.sink import SinkConfig, TelemetrySink
from stepwatch.errors import ValidationError
from stepwatch.schema import TelemetryEventV3, json_schema, validate_telemetry_record
from tests.schema.test_records import (
    CAPABILITY_BOOLS,
    CAPABILITY_STRINGS,
    INTEGER_FIELDS_V3,
    NON_NEGATIVE_BYTES,
    NULL_BREAK,
    SINGLE_FIELD_BREAKS_V3,
    V2_FIELDS,
    V2_REQUIRED,
    V3_FIELDS,
    V3_REQUIRED,
    V4_CAPABILITY_OF,
    V4_COUNTERS,
    json_text,
    json_values,
    make_capabilities,
    make_v2_record,
    make_v4_record,
    unknown_keys,
    v2_records,
    v3_rank_breaks,
    v3_records,
    v4_records,
    with_field,
)
from tests.support import examples
from tests.support.records import make_event, make_record

VALIDATORS = {v: jsonschema.Draft202012Validator(json_schema(v)) for v in (2, 3, 4)}
FIELDS = {2: V2_FIELDS, 3: V3_FIELDS, 4: V3_FIELDS}


def schema_error_fields(version: int, record: Any) -> set[str]:
    """The JSON paths the reference validator blames, in stepwatch's ``$.a.b`` notation."""
    fields = set()
    for error in VALIDATORS[version].iter_errors(record):
        where = "$" + "".join(f".{part}" for part in error.absolute_path)
        if error.validator == "required":
            fields.update(f"{where}.{name}" for name in error.validator_value if name not in error.instance)
        elif error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            fields.update(f"{where}.{name}" for name in error.instance if name not in known)
        else:
            fields.add(where)
    return fields


def stepwatch_error_field(record: Any) -> str | None:
    try:
        validate_telemetry_record(record)
    except ValidationError as error:
        return error.field
    return None


# --------------------------------------------------------------------------------------------
# the schema files themselves


@pytest.mark.parametrize("version", [2, 3, 4])
def test_shipped_schema_is_a_valid_draft_2020_12_schema(version: int) -> None:
    schema = json_schema(version)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert jsonschema.validators.validator_for(schema) is jsonschema.Draft202012Validator
    assert schema["properties"]["schema_version"]["const"] == version
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize(
    ("version", "required", "fields"),
    [(2, V2_REQUIRED, V2_FIELDS), (3, V3_REQUIRED, V3_FIELDS), (4, V3_REQUIRED, V3_FIELDS)],
)
def test_schema_fields_match_the_spec(version: int, required: tuple[str, ...], fields: tuple[str, ...]) -> None:
    schema = json_schema(version)
    assert sorted(schema["required"]) == sorted(required)
    assert sorted(schema["properties"]) == sorted(fields)


def test_v3_schema_matches_the_struct_fields() -> None:
    struct_fields = {f.name for f in msgspec.structs.fields(TelemetryEventV3)}
    assert struct_fields == set(json_schema(3)["properties"])
    required = {f.name for f in msgspec.structs.fields(TelemetryEventV3) if f.required}
    assert required == set(json_schema(3)["required"])


def test_v4_schema_requires_exact_memory_capabilities() -> None:
    caps = json_schema(4)["properties"]["metadata"]["properties"]["memory_capabilities"]
    assert json_schema(4)["properties"]["metadata"]["required"] == ["memory_capabilities"]
    assert caps["additionalProperties"] is False
    assert sorted(caps["required"]) == sorted(CAPABILITY_STRINGS + CAPABILITY_BOOLS)


# --------------------------------------------------------------------------------------------
# agreement on valid records


@pytest.mark.parametrize(("version", "record"), [(2, make_v2_record()), (3, make_record()), (4, make_v4_record())])
def test_example_records_are_valid_for_both(version: int, record: dict[str, Any]) -> None:
    VALIDATORS[version].validate(record)
    assert validate_telemetry_record(record).schema_version == version


@given(st.one_of(v2_records(), v3_records(), v4_records()))
def test_valid_records_are_accepted_by_both(record: dict[str, Any]) -> None:
    version = record["schema_version"]
    assert schema_error_fields(version, record) == set()
    assert validate_telemetry_record(record).schema_version == version


# --------------------------------------------------------------------------------------------
# agreement on records breaking one single-field rule


def _breaks_for(version: int) -> list[tuple[str, st.SearchStrategy[Any]]]:
    breaks = [(field, bad) for field, bad in SINGLE_FIELD_BREAKS_V3 if field in FIELDS[version]]
    if version == 4:
        # v4 counters are nullable, so null is not a break there
        breaks = [(f, bad) for f, bad in breaks if not (f in V4_COUNTERS and bad is NULL_BREAK)]
        whitespace = st.sampled_from([" ", "\t", " \n ", "\u3000"])
        breaks += [(name, whitespace) for name in ("session_id", "event_type", "collector", "host")]
    return breaks


@st.composite
def single_field_breaks(draw: st.DrawFn) -> tuple[int, dict[str, Any], str]:
    version = draw(st.sampled_from([2, 3, 4]))
    record = draw({2: v2_records, 3: v3_records, 4: v4_records}[version]())
    if version == 4 and draw(st.booleans()):
        return (version, *draw(v4_capability_breaks(record)))
    if draw(st.integers(min_value=0, max_value=20)) == 0:
        key = draw(unknown_keys.filter(lambda k: k not in FIELDS[version]))
        return version, with_field(record, key, draw(json_values)), f"$.{key}"
    field, bad = draw(st.sampled_from(_breaks_for(version)))
    return version, with_field(record, field, draw(bad)), f"$.{field}"


@st.composite
def v4_capability_breaks(draw: st.DrawFn, record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Breaks one rule of ``metadata.memory_capabilities`` that the v4 JSON Schema expresses."""
    caps = dict(record["metadata"]["memory_capabilities"])
    where = "$.metadata.memory_capabilities"
    kind = draw(st.sampled_from(["missing", "extra", "blank", "not-bool", "not-object", "absent"]))
    if kind == "missing":
        key = draw(st.sampled_from(sorted(caps)))
        del caps[key]
        where += f".{key}"
    elif kind == "extra":
        key = draw(json_text.filter(lambda k: k not in caps and "`" not in k))
        caps[key] = draw(json_values)
        where += f".{key}"
    elif kind == "blank":
        key = draw(st.sampled_from(CAPABILITY_STRINGS))
        caps[key] = draw(st.sampled_from(["", " ", "\t\n"]) | st.integers() | st.none())
        where += f".{key}"
    elif kind == "not-bool":
        key = draw(st.sampled_from(CAPABILITY_BOOLS))
        caps[key] = draw(st.integers() | st.none() | json_text)
        where += f".{key}"
    elif kind == "not-object":
        caps = draw(st.lists(st.integers(), max_size=2) | st.integers() | json_text)
    metadata = {k: v for k, v in record["metadata"].items() if k != "memory_capabilities"}
    if kind != "absent":
        metadata["memory_capabilities"] = caps
    return {**record, "metadata": metadata}, where


@settings(max_examples=examples(200))
@given(single_field_breaks())
def test_records_breaking_one_single_field_rule_are_rejected_by_both(
    broken: tuple[int, dict[str, Any], str],
) -> None:
    version, record, field = broken
    blamed = schema_error_fields(version, record)
    assert blamed, f"JSON Schema v{version} accepted a record breaking {field}"
    assert stepwatch_error_field(record) == field
    assert field in blamed, f"JSON Schema blamed {blamed}, stepwatch {field}"


# --------------------------------------------------------------------------------------------
# what only the Structs check


@given(v3_rank_breaks())
def test_rank_below_world_size_is_struct_only(broken: tuple[dict[str, Any], str]) -> None:
    record, field = broken
    assert schema_error_fields(3, record) == set()  # not expressible in JSON Schema
    assert stepwatch_error_field(record) == field


@pytest.mark.parametrize("field", ["device_used_bytes", "device_free_bytes"])
def test_v4_used_and_free_within_total_is_struct_only(field: str) -> None:
    record = make_v4_record(**{field: 8193}, device_total_bytes=8192)
    assert schema_error_fields(4, record) == set()
    assert stepwatch_error_field(record) == f"$.{field}"


@pytest.mark.parametrize(("counter", "capability"), sorted(V4_CAPABILITY_OF.items()))
def test_v4_capability_null_pairing_is_struct_only(counter: str, capability: str) -> None:
    nulls = {c: None for c, cap in V4_CAPABILITY_OF.items() if cap == capability and c != counter}
    record = make_v4_record(metadata={"memory_capabilities": make_capabilities(**{capability: False})}, **nulls)
    assert schema_error_fields(4, record) == set()
    assert stepwatch_error_field(record) == f"$.{counter}"


@pytest.mark.parametrize("field", [f for f in INTEGER_FIELDS_V3 if f not in ("rank", "local_rank")])
def test_integral_floats_are_rejected_by_stepwatch_only(field: str) -> None:
    """JSON Schema's `integer` is any number with a zero fractional part; stepwatch is stricter."""
    record = make_record(**{field: 1.0})
    assert schema_error_fields(3, record) == set()
    assert stepwatch_error_field(record) == f"$.{field}"
    # fractional values are rejected by both
    assert f"$.{field}" in schema_error_fields(3, make_record(**{field: 1.5}))


@pytest.mark.parametrize("field", NON_NEGATIVE_BYTES)
def test_byte_counter_minimum_is_in_both(field: str) -> None:
    record = make_record(**{field: -1})
    assert schema_error_fields(3, record) == {f"$.{field}"}
    assert stepwatch_error_field(record) == f"$.{field}"


# --------------------------------------------------------------------------------------------
# what the sink writes


def test_every_record_the_sink_writes_is_valid_v3(tmp_path: Path, session_id: str) -> None:
    sink = TelemetrySink(
        tmp_path / "sink",
        SinkConfig(flush_every_events=50, rollover_max_events=120, fsync="never"),
    )
    sink.start_session(None)
    session = sink.session
    assert session is not None
    written = []
    for i in range(300):
        event = make_event(
            session.session_id,
            i,
            event_type=("sample", "phase_enter", "phase_exit", "collector_degraded")[i % 4],
            job_id=None if i % 3 else f"job-{i}",
            rank=i % 4,
            local_rank=i % 2,
            world_size=4,
            allocator_active_bytes=None if i % 2 else i,
            device_total_bytes=None if i % 5 else 10**10,
            device_free_bytes=None if i % 5 else 10**10 - 1000 - i,
            context=None if i % 7 else f"step {i}",
            allocator_change_bytes=(-1) ** i * i,
        )
        sink.append(event)
        written.append(event)
    sink.close("completed")

    segments = sorted((tmp_path / "sink").glob("segment-*.jsonl"))
    assert len(segments) >= 2  # the rollover bound was crossed
    lines = [line for path in segments for line in path.read_bytes().splitlines()]
    assert len(lines) == len(written)
    for line, event in zip(lines, written, strict=True):
        record = msgspec.json.decode(line)
        VALIDATORS[3].validate(record)
        assert validate_telemetry_record(record) == event


# A real capture: the runtime in its own process, phases, progress, a collector that fails twice
# (collector_degraded, then collector_recovered), then shutdown.
_RUNTIME_RUN = r"""
import sys, time
import stepwatch
from stepwatch.capture.collectors import CollectorHealth, Reading

class Flaky:
    name = "stepwatch.cuda_tracker"
    backend = "cuda"
    supports_device_total = True
    supports_device_free = True
    sampling_source = "flaky"
    reads = 0
    def read(self):
        self.reads += 1
        if self.reads <= 2:
            raise RuntimeError(f"device lost {self.reads}")
        return [Reading(device_id=0, allocated=123, reserved=456, used=789, free=211, total=1000)]

rt = stepwatch.init(out=sys.argv[1], interval=0.05)
flaky = Flaky()
rt.devices.collectors.append(CollectorHealth(flaky, base_backoff_s=0.05))
with stepwatch.phase("train", epoch=0):
    for step in range(3):
        with stepwatch.phase("forward"):
            time.sleep(0.02)
        stepwatch.progress(step, loss=1.0 / (step + 1))
deadline = time.monotonic() + 10
while flaky.reads < 4 and time.monotonic() < deadline:
    time.sleep(0.05)
stepwatch.shutdown()
"""


@pytest.mark.real
def test_every_record_a_real_runtime_writes_is_valid_v3(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    proc = subprocess.run([sys.executable, "-c", _RUNTIME_RUN, str(run)], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr  # no internal error swallowed on the way
    segments = sorted(run.glob("telemetry/rank*/segment-*.jsonl"))
    assert segments
    kinds: set[str] = set()
    count = 0
    for path in segments:
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            record = msgspec.json.decode(line)
            errors = [e.message for e in VALIDATORS[3].iter_errors(record)]
            assert errors == [], f"{path.name}:{number}: {errors}"
            validate_telemetry_record(record)
            kinds.add(record["event_type"])
            count += 1
    assert count > 0
    expected = {"start", "stop", "phase_enter", "phase_exit", "sample", "collector_degraded", "collector_recovered"}
    assert expected <= kinds, kinds
