"""A finished session's run page, kept on disk so that a dashboard started later (a cold
``stepwatch ui``) serves it without reading the history again: at 64 ranks x 20,000 steps the
build costs 1.6 s of CPU, reading the kept page back and sending it 0.12 s (bench/bench_dashboard.py).

The run directory and the history are never written (the dashboard only reads them): the pages
live in a cache folder of the user's, ``$STEPWATCH_CACHE_DIR`` (``off`` turns the cache off), else
``$XDG_CACHE_HOME/stepwatch``, else ``~/.cache/stepwatch``, under ``pages/``, one gzip file per
(store, session), the newest ``KEEP`` kept.

A page is reused only under the key it was built under, taken *before* the build read anything:
this code's version (stepwatch's version and a digest of the ``views`` package's sources), the
store's path, the size, time and inode of the store and of its WAL when not empty (any write to
the history changes them: a session that gets more rows, or loses some to retention, is built
again; so is every session of a history another session is still writing to, and a page whose
history was written while it was built is not kept), the session's row, and the
size and time of the run directory's files a page reads (run.json's outcome, the final
summary, alerts.jsonl, the stack dumps in ``stacks/``). A running session's page is never kept.

Nothing here raises for a cache that cannot be read or written: the page is built as before.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..artifacts.alerts_log import ALERTS_FILE
from ..store.base import HistoryStore

__all__ = ["KEEP", "PageCache", "cache_folder", "page_key"]

KEEP = 64  # pages kept (a 64-rank x 20,000-step page is 0.4 MB compressed)


def cache_folder() -> Path | None:
    """Where the pages go, or None when ``STEPWATCH_CACHE_DIR=off``."""
    named = os.environ.get("STEPWATCH_CACHE_DIR")
    if named is not None:
        return None if named.strip().lower() in ("", "off", "0", "none") else Path(named) / "pages"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stepwatch" / "pages"


@lru_cache(maxsize=1)
def _code_version() -> str:
    """stepwatch's version and a digest of the sources that shape a page (this package)."""
    from .. import __version__

    digest = hashlib.sha256(__version__.encode())
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _file_stamp(path: Path, *, empty_is_none: bool = False) -> list[Any]:
    try:
        st = path.stat()
    except OSError:
        return [None, None, None]
    if empty_is_none and st.st_size == 0:
        return [None, None, None]
    return [st.st_size, st.st_mtime_ns, st.st_ino]


# the run directory's files a page reads (views.sources, the alerts log), besides its stacks/
_RUN_FILES = ("run.json", "final_summary.json", ALERTS_FILE)


def _dir_stamp(folder: Path | None) -> list[Any]:
    """(name, size, time) of each file of the run directory a page reads, and of its ``stacks/``."""
    if folder is None:
        return []
    stamps = [[name, *_file_stamp(folder / name)[:2]] for name in _RUN_FILES]
    out: list[Any] = [stamp for stamp in stamps if stamp[1] is not None]  # the same for no folder and an empty one
    try:
        entries = sorted(os.scandir(folder / "stacks"), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        try:
            if entry.is_file():
                st = entry.stat()
                out.append(["stacks/" + entry.name, st.st_size, st.st_mtime_ns])
        except OSError:
            continue
    return out


def page_key(store: HistoryStore, store_path: Path, session_id: str, run_dir: Path | None) -> list[Any] | None:
    """The key a page built now is kept under, or None (a running session: not kept). Taken
    before the page is built, so a write during the build only makes the next key differ."""
    # an empty WAL holds nothing: the first reader of a store whose writer has closed makes one
    files = [_file_stamp(store_path), _file_stamp(store_path.with_name(store_path.name + "-wal"), empty_is_none=True)]
    rows = store.query("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
    if not rows or rows[0].get("status") == "running":
        return None
    session = json.loads(json.dumps(rows[0], default=str))
    return [_code_version(), str(store_path.resolve()), session_id, files, session, _dir_stamp(run_dir)]


class PageCache:
    """Example::

        cache = PageCache()
        page = cache.get(store_path, session, key) or build()
        cache.put(store_path, session, key, page)
    """

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.hits = self.misses = self.failures = 0

    def _file(self, store_path: Path, session_id: str) -> Path | None:
        if self.folder is None:
            return None
        name = hashlib.sha256(f"{store_path.resolve()}\0{session_id}".encode()).hexdigest()[:32]
        return self.folder / f"{name}.json.gz"

    def get(self, store_path: Path, session_id: str, key: list[Any] | None) -> dict[str, Any] | None:
        """The page kept under ``key``, else None."""
        path = self._file(store_path, session_id)
        if path is None or key is None:
            return None
        try:
            with gzip.open(path, "rb") as handle:
                head = handle.readline()
                if json.loads(head) != key:
                    self.misses += 1
                    return None
                page = json.loads(handle.read())
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, EOFError):  # damaged or half written by another version: built again
            self.failures += 1
            return None
        self.hits += 1
        return page if isinstance(page, dict) else None

    def put(self, store_path: Path, session_id: str, key: list[Any] | None, page: dict[str, Any]) -> bool:
        """Keeps ``page`` under ``key`` (nothing for a None key); False when it could not."""
        path = self._file(store_path, session_id)
        if path is None or key is None:
            return False
        from ..artifacts._files import atomic_write_bytes

        body = (json.dumps(key, separators=(",", ":")) + "\n" +
                json.dumps(page, separators=(",", ":"), default=str)).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write_bytes(path, gzip.compress(body, compresslevel=5, mtime=0), fsync=False)
            self._prune()
        except OSError:
            self.failures += 1
            return False
        return True

    def _prune(self) -> None:
        """Drops all but the newest KEEP pages."""
        assert self.folder is not None
        pages = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".json.gz"):
                try:
                    pages.append((entry.stat().st_mtime_ns, entry.path))
                except OSError:
                    continue
        for _, path in sorted(pages, reverse=True)[KEEP:]:
            try:
                os.unlink(path)
            except OSError:
                pass
