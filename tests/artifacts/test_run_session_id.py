"""``run_session_id``: which session a run directory's run.json names, for the commands that only
need that (watch, serve, summary, explain), on any bytes a run.json may hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.artifacts.run_manifest import RunManifest, run_session_id, write_run_manifest
from tests.support import examples


def test_a_written_manifest_names_its_session(tmp_path: Path) -> None:
    write_run_manifest(tmp_path, RunManifest(session_id="s-1", started_at_ns=1))
    assert run_session_id(tmp_path) == "s-1"


def test_no_manifest_names_no_session(tmp_path: Path) -> None:
    assert run_session_id(tmp_path) is None


def test_a_manifest_damaged_elsewhere_still_names_its_session(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"session_id": "s-2", "started_at_ns": "not a number",
                                                   "schema_version": 99, "new_field": [1, 2]}))
    assert run_session_id(tmp_path) == "s-2"


@settings(max_examples=examples(300), deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["session_id", "x"]), inner,
                                                                              max_size=3), max_leaves=10)
    .map(lambda value: json.dumps(value).encode()),
    st.just(b"[" * 100_000),
))
def test_any_bytes_give_a_session_or_none(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "run.json").write_bytes(raw)
    found = run_session_id(run_dir)
    try:
        expected = json.loads(raw)
    except (ValueError, RecursionError):
        expected = None
    named = expected.get("session_id") if isinstance(expected, dict) else None
    assert found == (named if isinstance(named, str) and named else None)
