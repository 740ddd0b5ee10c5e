"""A finished session's run page kept on disk (views.page_cache): a later reader with the same
key gets the page back without building it; a store that changed, a run directory that changed
or a running session are built again; any bytes in a cache file are a miss, never an error."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepwatch.store.sqlite import SqliteStore
from stepwatch.views.page_cache import KEEP, PageCache, cache_folder, page_key
from stepwatch.views.run_page import run_page
from tests.support.history import write_run


def _key(path: Path, session: str, run_dir: Path | None = None) -> list[object] | None:
    with SqliteStore(path, read_only=True) as store:
        return page_key(store, path, session, run_dir)


def _build(path: Path, session: str, run_dir: Path | None = None) -> dict[str, object]:
    with SqliteStore(path, read_only=True) as store:
        return run_page(store, session, run_dir)


@pytest.fixture
def history(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "history.sqlite"
    path.parent.mkdir()
    with SqliteStore(path) as store:
        write_run(store, "done", 4, 300)
    return path


def test_a_kept_page_comes_back_under_the_same_key(history: Path, tmp_path: Path) -> None:
    cache = PageCache(tmp_path / "pages")
    key = _key(history, "done", history.parent)
    page = _build(history, "done", history.parent)
    assert cache.get(history, "done", key) is None and cache.misses == 1
    assert cache.put(history, "done", key, page)
    later = PageCache(tmp_path / "pages")  # another process: nothing in memory
    again = later.get(history, "done", _key(history, "done", history.parent))
    assert again == json.loads(json.dumps(page, default=str)) and later.hits == 1
    assert again["session"]["steps"] == 300


def test_a_session_that_gets_more_rows_is_built_again(history: Path, tmp_path: Path) -> None:
    cache = PageCache(tmp_path / "pages")
    key = _key(history, "done")
    cache.put(history, "done", key, _build(history, "done"))
    with SqliteStore(history) as store:  # ten late steps of every rank
        write_run(store, "done", 4, 10, first_step=300)
    fresh = _key(history, "done")
    assert fresh != key
    assert cache.get(history, "done", fresh) is None
    assert _build(history, "done")["session"]["steps"] == 310


def test_a_changed_run_directory_is_built_again(history: Path, tmp_path: Path) -> None:
    key = _key(history, "done", history.parent)
    (history.parent / "alerts.jsonl").write_text("{}\n")  # an alert written after the page was kept
    assert _key(history, "done", history.parent) != key
    (history.parent / "stacks").mkdir()
    before = _key(history, "done", history.parent)
    (history.parent / "stacks" / "rank0.txt").write_text("Thread 1\n")
    assert _key(history, "done", history.parent) != before


def test_a_running_session_is_never_kept(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    with SqliteStore(path) as store:
        write_run(store, "live", 2, 20, status="running")
    assert _key(path, "live") is None
    cache = PageCache(tmp_path / "pages")
    assert not cache.put(path, "live", None, _build(path, "live"))
    assert not (tmp_path / "pages").exists()


def test_only_the_newest_pages_are_kept(history: Path, tmp_path: Path) -> None:
    cache = PageCache(tmp_path / "pages")
    key = _key(history, "done")
    for i in range(KEEP + 3):
        assert cache.put(history, f"s{i}", key, {"n": i})
    assert len(list((tmp_path / "pages").glob("*.json.gz"))) == KEEP


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEPWATCH_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_folder() == tmp_path / "mine" / "pages"
    monkeypatch.setenv("STEPWATCH_CACHE_DIR", "off")
    assert cache_folder() is None
    monkeypatch.delenv("STEPWATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "stepwatch" / "pages"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode), st.booleans())
def test_any_bytes_in_a_cache_file_are_a_miss_or_the_page(history: Path, body: bytes, compressed: bool) -> None:
    cache = PageCache(history.parent / "pages")
    key = ["k", 1]
    path = cache._file(history, "done")
    assert path is not None
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(gzip.compress(body) if compressed else body)
    found = cache.get(history, "done", key)
    assert found is None or isinstance(found, dict)
    if found is not None:  # only a compressed file whose first line is the key
        assert compressed and json.loads(body.split(b"\n", 1)[0]) == key
