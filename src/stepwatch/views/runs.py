"""The runs page: one row per session under a catalog's path, with what tells runs apart at a
glance (command, start, duration, outcome, ranks, steps, primary verdict, alerts).

The primary verdict comes from what the run already decided (its final_summary.json, else the
live verdict's last change): a list of many runs never re-diagnoses each one.
"""

from __future__ import annotations

from typing import Any

from ..errors import StepwatchError
from .sources import Catalog, command_of, final_summary_of, run_json_of

__all__ = ["runs_list"]


def runs_list(catalog: Catalog) -> dict[str, Any]:
    """``{"path", "runs": [...], "problems": [...]}``; a store that cannot be read is a problem
    line naming it, the others still listed."""
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    for located in catalog.stores():
        try:
            with catalog.open(located) as store:
                for row in store.sessions():
                    runs.append(_row(store, row, located.run_dir))
        except StepwatchError as exc:
            problems.append(f"{located.store}: cannot be read: {exc}")
    runs.sort(key=lambda r: -(r["started_at_ns"] or 0))
    if not runs and not problems:
        problems.append(f"no sessions under {catalog.path}: point stepwatch ui at a run directory, a "
                        "history.sqlite or a serve --out directory")
    return {"path": str(catalog.path), "runs": runs, "problems": problems}


def _row(store: Any, session: dict[str, Any], run_dir: Any) -> dict[str, Any]:
    from .run_page import last_steps

    session_id = session["session_id"]
    run = run_json_of(run_dir, session_id)
    command = command_of(run, session)
    extents = last_steps(store, session_id)
    started, ended = session.get("started_at_ns"), session.get("ended_at_ns")
    summary = final_summary_of(run_dir, session_id)
    primary = None
    if summary is not None:
        found = (summary.get("diagnosis") or {}).get("primary")
        primary = found.get("name") if isinstance(found, dict) else None
    if primary is None:
        try:
            latest = store.query("SELECT name FROM verdicts WHERE session_id = ? ORDER BY ts_ns DESC LIMIT 1",
                                 (session_id,))
        except StepwatchError:  # a history written before the verdicts table
            latest = []
        primary = latest[0]["name"] if latest else None
    try:
        alerts = store.count("alerts", session_id)
    except StepwatchError:
        alerts = 0
    if not alerts and summary is not None:
        alerts = len(summary.get("alerts") or [])
    if ended is None and session.get("status") == "running":
        last = store.query("SELECT MAX(end_ns) AS t FROM steps WHERE session_id = ?", (session_id,))
        ended_for_duration = last[0]["t"] if last else None
    else:
        ended_for_duration = ended
    return {
        "session_id": session_id, "command": " ".join(str(w) for w in command) if command is not None else None,
        "started_at_ns": started, "duration_s": round((ended_for_duration - started) / 1e9, 3)
        if isinstance(started, int) and isinstance(ended_for_duration, int) else None,
        "status": session.get("status"), "outcome": run.get("outcome"),
        "ranks": len(extents) or session.get("world_size"),
        "steps": max((b + 1 for _, b in extents.values()), default=0),
        "primary": primary, "alerts": alerts, "host": session.get("host"), "source": session.get("source"),
    }
