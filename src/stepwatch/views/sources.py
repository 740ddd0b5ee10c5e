"""Where the sessions a surface shows are: a run directory, a history store, a ``serve --out``
directory of many sessions, a directory of run directories (``stepwatch_runs/``), or a store
URL (``clickhouse://host:9000/db``: one store holding every session of its database, with no run
directory beside it).

A ``Catalog`` finds the stores under its path each time it is asked (runs appear while a
dashboard is open) and opens them read-only, one connection per use, so a reader never holds
the aggregator's writer back (SQLite in WAL mode: readers see whole transactions only). A run
directory with no history (``track``, ``stepwatch.init`` alone) is imported into a temporary
store, once, and nothing is written into the run directory.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ArtifactError, StepwatchError
from ..schema.limits import id_problem
from ..store.base import HistoryStore

__all__ = ["Catalog", "Located", "NoSuchSession", "check_session_id", "command_of", "final_summary_of", "run_json_of"]

HISTORY = "history.sqlite"
_STORE_SUFFIXES = (".sqlite", ".db")


class NoSuchSession(StepwatchError):
    """A session id that no store under the catalog's path holds."""


def check_session_id(value: str) -> str:
    """``value`` when it is an id the ingestion path would accept (schema.limits), else
    ValueError saying why: what a URL names is checked before it reaches a query."""
    problem = id_problem(value)
    if problem is not None:
        raise ValueError(f"session id {problem}")
    return value


class Located(NamedTuple):
    """One store and the run directory its artifacts (run.json, alerts.jsonl, stacks/) are in.
    ``store``: a file, or the URL of a store on a server (``is_url``; no run directory)."""

    store: Path | str
    run_dir: Path | None

    @property
    def is_url(self) -> bool:
        return isinstance(self.store, str)


class Catalog:
    """Example::

        catalog = Catalog(Path("stepwatch_runs"))
        for located in catalog.stores(): ...
        with catalog.open_session(session_id) as (store, run_dir): ...
    """

    def __init__(self, path: Path | str) -> None:
        from ..store.open import is_store_url

        self.url: str | None = path if isinstance(path, str) and is_store_url(path) else None
        # what pages and messages name: a URL without its password (the store's own str)
        self.path: Path | str = _shown(path) if self.url is not None else Path(path)
        if self.url is None and not Path(path).exists():
            raise ArtifactError(self.path, "no such file or directory")
        self._imported: dict[Path, Path] = {}  # run dir without history -> its temporary store
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._lock = threading.Lock()
        self._owner: dict[str, Located] = {}  # session id -> where it was last found

    def stores(self) -> list[Located]:
        """Every store under the path, found now (a URL: that one store)."""
        if self.url is not None:
            return [Located(self.url, None)]
        path = Path(self.path)
        if path.is_file():
            if path.suffix not in _STORE_SUFFIXES:
                raise ArtifactError(path, "not a history store (a .sqlite file) nor a run directory")
            parent = path.parent if (path.parent / "run.json").is_file() else None
            return [Located(path, parent)]
        found = self._store_of(path)
        if found is not None:
            return [found]
        out = []
        try:
            children = sorted(p for p in path.iterdir() if p.is_dir())
        except OSError as exc:
            raise ArtifactError(path, f"cannot list: {exc.strerror or exc}") from exc
        for child in children:
            located = self._store_of(child)
            if located is not None:
                out.append(located)
        return out

    def _store_of(self, directory: Path) -> Located | None:
        if (directory / HISTORY).is_file():
            return Located(directory / HISTORY, directory)
        if (directory / "run.json").is_file() or (directory / "spool").is_dir() or (directory / "telemetry").is_dir():
            return Located(self._import(directory), directory)
        return None

    def _import(self, run_dir: Path) -> Path:
        """The temporary store of a run directory with no history, imported once."""
        with self._lock:
            known = self._imported.get(run_dir)
            if known is not None:
                return known
            from ..store.importers import import_path
            from ..store.sqlite import SqliteStore

            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="stepwatch-ui-")
            target = Path(self._tmp.name) / f"{len(self._imported)}.sqlite"
            with SqliteStore(target) as store:
                try:
                    import_path(run_dir, store)
                except ArtifactError:
                    pass  # an empty store: the page says the run holds no session
            self._imported[run_dir] = target
            return target

    def imported(self, located: Located) -> bool:
        """Whether ``located`` is a temporary store this catalog imported (gone when it closes)."""
        with self._lock:
            return located.store in self._imported.values()

    @contextmanager
    def open(self, located: Located) -> Iterator[HistoryStore]:
        """The store, read-only, closed after use."""
        from ..store.open import open_store
        from ..store.sqlite import SqliteStore

        store = open_store(located.store, read_only=True) if located.is_url else SqliteStore(located.store,
                                                                                            read_only=True)
        try:
            yield store
        finally:
            store.close()

    def sessions(self) -> list[tuple[Located, dict[str, Any]]]:
        """(where, its sessions row) of every session under the path, newest first. A store that
        cannot be read raises StoreError naming it."""
        out: list[tuple[Located, dict[str, Any]]] = []
        for located in self.stores():
            with self.open(located) as store:
                for row in store.sessions():
                    out.append((located, row))
                    self._owner[row["session_id"]] = located
        out.sort(key=lambda item: -(item[1].get("started_at_ns") or 0))
        return out

    def locate(self, session_id: str) -> Located:
        """Where ``session_id`` is; NoSuchSession when nowhere under the path."""
        check_session_id(session_id)
        known = self._owner.get(session_id)
        if known is not None and (known.is_url or Path(known.store).exists()):
            return known
        for located in self.stores():
            with self.open(located) as store:
                if store.query("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)):
                    self._owner[session_id] = located
                    return located
        raise NoSuchSession(f"no session {session_id} under {self.path}")

    @contextmanager
    def open_session(self, session_id: str) -> Iterator[tuple[HistoryStore, Path | None]]:
        located = self.locate(session_id)
        with self.open(located) as store:
            yield store, located.run_dir

    def default_session(self) -> str | None:
        """The run's own session (run.json) when the path is one run, else the newest."""
        own = _run_json(self.path).get("session_id") if isinstance(self.path, Path) and self.path.is_dir() else None
        sessions = self.sessions()
        if isinstance(own, str) and any(row["session_id"] == own for _, row in sessions):
            return own
        return sessions[0][1]["session_id"] if sessions else None

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _shown(url: str) -> str:
    """``url`` as messages name it: without its password (a URL the store parser refuses is
    refused when opened, with its message)."""
    from ..store.clickhouse_url import is_clickhouse_url, parse_clickhouse_url

    if is_clickhouse_url(url):
        try:
            return str(parse_clickhouse_url(url))
        except StepwatchError:
            return url.split("://", 1)[0] + "://..."
    return url


def _run_json(run_dir: Path | str | None) -> dict[str, Any]:
    """run.json of ``run_dir`` as a dict ({} when absent or unreadable)."""
    if not isinstance(run_dir, Path):
        return {}
    try:
        value = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def run_json_of(run_dir: Path | None, session_id: str) -> dict[str, Any]:
    """run.json of ``run_dir`` when it describes ``session_id`` ({} otherwise)."""
    data = _run_json(run_dir)
    return data if data.get("session_id") == session_id else {}


def command_of(run: dict[str, Any], session: dict[str, Any]) -> list[str] | None:
    """The run's command line: run.json's, else the sessions row's JSON text (a run with no
    run.json, such as a `serve` session's)."""
    command = run.get("command_line")
    if command is None and session.get("command_line"):
        try:
            command = json.loads(session["command_line"])
        except ValueError:
            command = None
    return command if isinstance(command, list) else None


def final_summary_of(run_dir: Path | None, session_id: str) -> dict[str, Any] | None:
    """final_summary.json of ``run_dir`` when it is ``session_id``'s."""
    if run_dir is None:
        return None
    try:
        value = json.loads((run_dir / "final_summary.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and value.get("session_id") == session_id else None

