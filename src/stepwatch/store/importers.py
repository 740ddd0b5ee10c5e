"""``stepwatch import``: artifacts written offline (by stepwatch or the tools it replaces) into a
history store, through the same row converters the aggregator uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from .._decode import DECODE_FAILURES
from ..errors import ArtifactError
from ..schema import synthetic_session_id
from .base import HistoryStore
from .rows import heartbeat_row, to_rows

__all__ = ["import_alerts", "import_ledgers", "import_path"]


def _run_session(path: Path) -> str | None:
    manifest = path / "run.json"
    if manifest.is_file():
        try:
            value = msgspec.json.decode(manifest.read_bytes()).get("session_id")
        except (*DECODE_FAILURES, OSError, AttributeError):  # unreadable: the session comes from elsewhere
            return None
        return value if isinstance(value, str) else None
    return None


def import_path(path: str | Path, store: HistoryStore) -> dict[str, int]:
    """Imports every artifact found at ``path``; returns rows written per table.

    Accepts a run directory, a telemetry sink (or its manifest/segment), a JSON export, a spool
    directory (ours or ``.cirron/spool``) or one of its batch files, or heartbeat ``*.jsonl`` files.
    """
    from ..artifacts.heartbeat import read_heartbeat
    from ..artifacts.spool import find_spool_dir, is_spool_batch, read_spool
    from ..artifacts.telemetry_loader import find_sink_dirs, load_telemetry_sessions

    root = Path(path)
    if not root.exists():
        raise ArtifactError(root, "no such file or directory")
    written: dict[str, int] = {}
    run_session = _run_session(root) if root.is_dir() else None
    found = False

    def put(session_id: str, rank: int, tables: dict[str, list[Any]], source: str, meta: dict[str, Any] | None = None) -> None:
        store.upsert_session({"session_id": session_id, "status": (meta or {}).get("status"),
                              "started_at_ns": (meta or {}).get("started_at_ns"), "ended_at_ns": (meta or {}).get("ended_at_ns"),
                              "host": (meta or {}).get("host"), "world_size": (meta or {}).get("world_size"),
                              "source": source, "command_line": None})
        rows = to_rows(tables, session_id, rank)
        store.append_many(rows)
        for table, items in rows.items():
            written[table] = written.get(table, 0) + len(items)

    is_heartbeat = root.is_file() and root.name.startswith("heartbeat_rank")
    # A spool batch file (``<run>/spool/<created_ns>-<batch_id>.json``) is not a telemetry export:
    # it imports as that batch, under the session its whole spool would get.
    batch_file = root.is_file() and not is_heartbeat and is_spool_batch(root)
    if batch_file:
        run_session = _run_session(root.parent.parent) if root.parent.name == "spool" else None
    has_telemetry = not is_heartbeat and not batch_file and (root.is_file() or bool(find_sink_dirs(root)))
    if has_telemetry:
        found = True
        for session in load_telemetry_sessions(root):
            s = session.summary
            by_rank: dict[int, list[Any]] = {}
            for event in session.events:
                by_rank.setdefault(event.rank, []).append(msgspec.to_builtins(event))
            for rank, events in by_rank.items():
                put(s.session_id, rank, {"telemetry": events}, f"import:{s.source}",
                    {"status": s.status, "started_at_ns": s.started_at_ns, "ended_at_ns": s.ended_at_ns,
                     "host": s.host, "world_size": s.world_size})
    spool_dir = root.parent if batch_file else find_spool_dir(root) if root.is_dir() else None
    if spool_dir is not None:
        found = True
        spool = read_spool(root if batch_file else spool_dir)
        session_id = run_session or synthetic_session_id(str(spool_dir.resolve()), "spool")
        by_rank_spans: dict[int, dict[str, list[Any]]] = {}
        for span in spool.spans:
            by_rank_spans.setdefault(int(span.get("rank") or 0), {"spans": [], "marks": [], "snapshots": []})["spans"].append(span)
        span_rank = {s["id"]: int(s.get("rank") or 0) for s in spool.spans}
        for mark in spool.marks:
            rank = span_rank.get(mark.get("span_id"), 0)
            by_rank_spans.setdefault(rank, {"spans": [], "marks": [], "snapshots": []})["marks"].append(mark)
        for snap in spool.snapshots:
            rank = span_rank.get(snap.get("span_id"), 0)
            by_rank_spans.setdefault(rank, {"spans": [], "marks": [], "snapshots": []})["snapshots"].append(snap)
        for rank, tables in by_rank_spans.items():
            put(session_id, rank, tables, "import:spool")
    heartbeat_files = [root] if is_heartbeat else sorted(root.glob("heartbeat_rank*.jsonl")) if root.is_dir() else []
    for file in heartbeat_files:
        found = True
        session_id = run_session or _run_session(file.parent) or synthetic_session_id(str(file.resolve()), "heartbeat")
        records = read_heartbeat(file)
        rows = [heartbeat_row(r, session_id) for r in records]
        store.upsert_session({"session_id": session_id, "status": None, "started_at_ns": None, "ended_at_ns": None,
                              "host": None, "world_size": None, "source": "import:heartbeat", "command_line": None})
        store.append_many({"heartbeats": rows})
        written["heartbeats"] = written.get("heartbeats", 0) + len(rows)
    if root.is_dir() and run_session is not None:
        added = import_ledgers(root, run_session, store)
        if added:
            written["steps"] = written.get("steps", 0) + added
    if root.is_dir() and (root / "alerts.jsonl").is_file():
        added = import_alerts(root, store, run_session)
        if added:
            written["alerts"] = written.get("alerts", 0) + added
    if not found:
        raise ArtifactError(root, "nothing to import (no telemetry, spool or heartbeat files)")
    return written


def import_ledgers(run_dir: Path, session_id: str, store: HistoryStore) -> int:
    """The steps of the ranks' step ledgers (artifacts/step_ledger.py) that the history lacks:
    those a rank closed after its last spool seal and send, before a SIGKILL. Steps already
    stored are kept (the history's steps are unique by session, rank and step); returns how
    many the ledgers added."""
    from ..artifacts.step_ledger import ledger_step_rows

    rows = ledger_step_rows(run_dir, session_id)
    if not rows:
        return 0
    before = store.count("steps", session_id)
    store.append_many({"steps": rows})
    return store.count("steps", session_id) - before


def import_alerts(run_dir: Path, store: HistoryStore, session_id: str | None = None) -> int:
    """The watchdog's alerts of ``<run>/alerts.jsonl`` (docs/watchdog.md) that the history lacks
    (the alerts table has no unique key: an alert already stored, by session, time and kind, is
    skipped); a line without a session is the run's (``session_id``). Returns how many were added."""
    from ..artifacts.alerts_log import read_alerts

    rows = []
    seen: dict[str, set[tuple[int, str]]] = {}
    for record in read_alerts(run_dir):
        session = record.get("session_id") if isinstance(record.get("session_id"), str) else session_id
        if session is None:
            continue
        if session not in seen:
            seen[session] = {(r["ts_ns"], r["kind"]) for r in store.query(
                "SELECT ts_ns, kind FROM alerts WHERE session_id = ?", (session,))}
        key = (int(float(record["ts"]) * 1e9), str(record["kind"]))
        if key in seen[session]:
            continue
        seen[session].add(key)
        ranks = record.get("ranks")
        step = record.get("step")
        rows.append({"session_id": session, "ts_ns": key[0], "kind": key[1],
                     "severity": str(record.get("severity") or ""),
                     "ranks": ranks if isinstance(ranks, list) else [],
                     "step": step if type(step) is int else None, "message": str(record.get("message") or ""),
                     "evidence": record.get("evidence") if isinstance(record.get("evidence"), dict) else {}})
    if rows:
        store.append_many({"alerts": rows})
    return len(rows)
