"""The verdict a snapshot shows when no history holds a live one: an ended run's diagnosis
(``final_summary.json``), or, for a run with no history at all (``init``, ``track``, an aggregator
that never started), the verdict engine over the ledgers' last steps, as the aggregator would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from ..._decode import DECODE_FAILURES
from ...phases import PHASES, RESIDUAL

__all__ = ["OwnVerdict", "final_primary", "final_summary"]

OWN_VERDICT_EVERY_S = 10.0  # a run with no history: the engine over the ledgers this often
_VERDICT_KEYS = ("name", "severity", "ranks", "message", "next_step")
_json = msgspec.json.Decoder()


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path`` (None: missing, damaged, or not an object)."""
    try:
        value = _json.decode(path.read_bytes())
    except (OSError, *DECODE_FAILURES):
        return None
    return value if isinstance(value, dict) else None


def final_summary(run_dir: Path, session_id: str | None) -> dict[str, Any] | None:
    """The session's ``final_summary.json`` (None: none yet, or another session's)."""
    summary = read_json_object(run_dir / "final_summary.json")
    if summary is None or summary.get("session_id") not in (None, session_id):
        return None
    return summary


def final_primary(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The primary verdict of a final summary's diagnosis (None: none in it)."""
    diagnosis = summary.get("diagnosis")
    primary = diagnosis.get("primary") if isinstance(diagnosis, dict) else None
    if not isinstance(primary, dict) or not isinstance(primary.get("name"), str):
        return None
    return {key: primary.get(key) for key in _VERDICT_KEYS}


class OwnVerdict:
    """The engine's primary verdict over the ledgers' last ``window`` steps, every
    ``OWN_VERDICT_EVERY_S``. WARMUP and too few steps are no verdict."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._verdict: dict[str, Any] | None = None
        self._at = float("-inf")

    def get(self, session_id: str | None, windows: dict[int, Any], now: float) -> dict[str, Any] | None:
        """``windows``: each rank's last ledger records (``MappedLedger.window``)."""
        if not windows:
            return None
        if now - self._at < OWN_VERDICT_EVERY_S:
            return self._verdict
        self._at = now
        try:
            from ...analysis.verdicts.engine import diagnose

            primary = diagnose(window_rows(session_id, windows), window=self.window).primary
        except Exception:  # noqa: BLE001 - a view without a verdict is still a view
            return self._verdict
        if primary.name in ("WARMUP", "INSUFFICIENT_STEP_TIME_DATA"):
            self._verdict = None
        else:
            self._verdict = {"name": primary.name, "severity": primary.severity, "ranks": list(primary.ranks),
                             "message": primary.message, "next_step": primary.next_step, "source": "view"}
        return self._verdict


def window_rows(session_id: str | None, windows: dict[int, Any]) -> list[dict[str, Any]]:
    """The ledger windows as the history's ``steps`` rows (store/rows: ``wait`` is the step less
    every phase inside the residual)."""
    rows = []
    for rank, records in windows.items():
        for record in records.tolist():
            _, index, start, end, phases, _ = record
            row = {"session_id": session_id, "rank": rank, "step": index, "start_ns": start, "end_ns": end,
                   "step_ns": end - start}
            inside = 0
            for phase, value in zip(PHASES, (int(v) for v in phases), strict=False):  # numpy's, as ints
                row[phase.column] = value
                inside += value if phase.in_residual else 0
            row[RESIDUAL.column] = max(0, end - start - inside)
            rows.append(row)
    return rows
