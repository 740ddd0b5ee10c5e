"""The compare page: two runs' step time overlaid, and ``stepwatch compare``'s verdict on them
(``analysis.compare``: B against A), computed from the same summaries the CLI compares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .sources import Catalog, final_summary_of, run_json_of

__all__ = ["compare_page", "summary_of"]


def summary_of(store: Any, session_id: str, run_dir: Path | None) -> dict[str, Any]:
    """The run's final summary: its final_summary.json, else built from the store."""
    written = final_summary_of(run_dir, session_id)
    if written is not None:
        return written
    from ..analysis.summary import build_summary

    return build_summary(store, session_id, run_dir)


def _workload(run_dir: Path | None, session_id: str) -> str | None:
    """The script a run ran (run.json's first word that is not an option), as ``compare`` reads it."""
    command = run_json_of(run_dir, session_id).get("command_line")
    if not isinstance(command, list):
        return None
    words = [w for w in command if isinstance(w, str) and not w.startswith("-")]
    return Path(words[0]).name if words else None


def compare_page(catalog: Catalog, a: str, b: str) -> dict[str, Any]:
    """``{"a": {...}, "b": {...}, "verdict": ..., "metrics": [...]}``: each run's header and its
    step time per rank (downsampled as on its run page), the verdict and the metric table."""
    from ..analysis.compare import compare_verdict
    from ..analysis.summary import compare_summaries
    from .run_page import _step_charts, last_steps, session_header

    sides: dict[str, dict[str, Any]] = {}
    summaries = []
    workloads = []
    for name, session_id in (("a", a), ("b", b)):
        with catalog.open_session(session_id) as (store, run_dir):
            summary = summary_of(store, session_id, run_dir)
            charts, _ = _step_charts(store, session_id, last_steps(store, session_id))
            sides[name] = {"session": session_header(store, session_id, run_dir), "step_time": charts["step_time"],
                           "primary": ((summary.get("diagnosis") or {}).get("primary") or {}).get("name")}
            summaries.append(summary)
            workloads.append(_workload(run_dir, session_id))
    verdict = compare_verdict(summaries[0], summaries[1], workload_a=workloads[0], workload_b=workloads[1])
    return {**sides, "verdict": verdict, "metrics": compare_summaries(summaries[0], summaries[1])}
