"""Pure analysis over loaded telemetry: the same functions serve the CLI, reports and live views.

The names below load their module on first use, so ``import stepwatch.analysis`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TimelineMarker": "markers",
    "derive_timeline_markers": "markers",
    "derive_session_timeline_markers": "markers",
    "derive_outcome_markers": "markers",
    "derive_verdict_markers": "markers",
    "timeline_marker_to_dict": "markers",
    "PhaseAttribution": "phase_replay",
    "PhaseInterval": "phase_replay",
    "PhaseReplayIndex": "phase_replay",
    "PhaseSummary": "phase_replay",
    "Diagnosis": "verdicts",
    "Verdict": "verdicts",
    "VerdictPolicy": "verdicts",
    "diagnose": "verdicts",
    "diagnose_store": "verdicts",
    "load_policy": "verdicts",
    "load_verdict_inputs": "verdicts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
