"""The ClickHouse DDL as a pure function of the server's features (no server needed): 18.16 gets
exactly the tables it always got (a database made before keeps matching), a current server the
modern variant. The statements themselves run on real engines in test_clickhouse.py (18.16) and
test_clickhouse_modern.py (chdb, 26.x)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stepwatch.store.base import COLUMNS
from stepwatch.store.clickhouse_ddl import LAYOUT, ServerFeatures, ddl, retention_ddl, sessions_ddl

OLD = ServerFeatures.from_version("18.16.1")
NEW = ServerFeatures.from_version("26.9.2.1")
_MODERN_WORDS = ("DateTime64", "LowCardinality", "CODEC", "TTL", "DICTIONARY")


def test_18_16_gets_the_tables_it_always_got() -> None:
    assert not OLD.modern and NEW.modern
    assert ddl("steps", OLD, "db") == [
        "CREATE TABLE IF NOT EXISTS steps_rows (session_id String, rank Int64, step Int64, start_ns Nullable(Int64), "
        "end_ns Nullable(Int64), step_ns Nullable(Int64), data_load_ns Nullable(Int64), h2d_ns Nullable(Int64), "
        "forward_ns Nullable(Int64), backward_ns Nullable(Int64), optimizer_ns Nullable(Int64), "
        "recompute_ns Nullable(Int64), wait_ns Nullable(Int64)) ENGINE = ReplacingMergeTree() "
        "PARTITION BY toYYYYMMDD(toDateTime(intDiv(ifNull(start_ns, 0), 1000000000))) ORDER BY (session_id, rank, step)",
        "CREATE VIEW IF NOT EXISTS steps AS SELECT toNullable(session_id) AS session_id, toNullable(rank) AS rank, "
        "toNullable(step) AS step, start_ns, end_ns, step_ns, data_load_ns, h2d_ns, forward_ns, backward_ns, "
        "optimizer_ns, recompute_ns, wait_ns FROM steps_rows FINAL"]
    statements = [s for table in LAYOUT for s in ddl(table, OLD, "db")] + sessions_ddl(OLD) + retention_ddl(OLD, "db")
    assert not any(word in s for s in statements for word in _MODERN_WORDS)


def test_a_current_server_gets_the_modern_types_and_ttl_retention() -> None:
    (table, view) = ddl("telemetry", NEW, "db")
    assert "timestamp_ns DateTime64(9, 'UTC') CODEC(DoubleDelta, ZSTD(1))" in table
    assert "event_type LowCardinality(String)" in table and "host LowCardinality(Nullable(String))" in table
    assert "TTL toDateTime(timestamp_ns, 'UTC') DELETE WHERE toUnixTimestamp64Nano(timestamp_ns) < " \
           "dictGetInt64('db.retention_cutoffs_dict'" in table
    assert "toNullable(toUnixTimestamp64Nano(timestamp_ns)) AS timestamp_ns" in view
    assert "TTL" not in ddl("alerts", NEW, "db")[0]  # not trimmed by retention, as on SQLite
    assert any("CREATE DICTIONARY" in s for s in retention_ddl(NEW, "db"))
    for name in LAYOUT:  # every view names SQLite's columns, in order
        view = ddl(name, NEW, "db")[1]
        assert [part.split(" AS ")[-1].strip() for part in view.split(" FROM ")[0][len(f"CREATE VIEW IF NOT EXISTS "
                f"{name} AS SELECT "):].split(", ")] == [c for c, _ in COLUMNS[name]]


@given(st.tuples(st.integers(0, 40), st.integers(0, 20), st.integers(0, 9)), st.sampled_from(["", ".1", "-testing"]))
def test_features_follow_the_version(version: tuple[int, int, int], tail: str) -> None:
    features = ServerFeatures.from_version(".".join(map(str, version)) + tail)
    assert features.version == version
    assert features.modern == (version >= (20, 1))
    assert features.ttl == (version >= (19, 6)) and features.codec == (version >= (19, 11))
    assert ddl("steps", features, "db") == ddl("steps", features, "db")  # pure: the same input, the same DDL
    assert ("DateTime64" in ddl("steps", features, "db")[0]) == features.modern
