"""The diagnosis of one stored session: the verdict engine (``analysis.verdicts``) over the rows of
a history store, and the lines that put it first in the text summary and ``stepwatch explain``.

Kept apart from the engine so the surfaces (final summary, ``explain``, the live aggregator) read
the store one way, and apart from ``summary`` so that module only gains a field and two lines.
Reads only the store it is handed (the analysis layer's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import StoreError
from ...store.base import HistoryStore
from .inputs import diagnose_store, load_verdict_inputs
from .step_columns import StepColumns

__all__ = ["diagnosis_lines", "evidence_text", "summary_diagnosis", "verdict_line"]

_EVIDENCE_ITEMS = 10  # scalar evidence items shown in the text; the JSON has all of them


def summary_diagnosis(store: HistoryStore, session_id: str, policy: Any = None,
                      steps: StepColumns | None = None) -> dict[str, Any]:
    """The final summary's ``diagnosis`` (``Diagnosis.to_dict()``) of the session's steps (read
    here unless the summary hands over ``session_steps``); an engine that fails costs the
    diagnosis only, never the summary: then ``primary`` is None and ``error`` says why."""
    try:
        inputs = None if steps is None else load_verdict_inputs(store, session_id, steps=steps)
        return diagnose_store(store, session_id, policy=policy, inputs=inputs).to_dict()
    except StoreError:  # a damaged history is the caller's error to report
        raise
    except Exception as exc:  # noqa: BLE001 - the rest of the summary must still be written
        return {"primary": None, "step_time": [], "memory": [], "system": [],
                "error": f"{type(exc).__name__}: {exc}"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) <= 8 and all(not isinstance(v, (dict, list)) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def evidence_text(evidence: Mapping[str, Any]) -> str:
    """The evidence in one line: its numbers first (``key value``), then nested maps one level
    deep (``outer.key value``), the window as the steps it covers; the JSON keeps everything."""
    scalars: list[str] = []
    nested: list[str] = []
    window = evidence.get("window")
    for key, value in evidence.items():
        if key == "window":
            continue
        if isinstance(value, Mapping):
            nested += [f"{key}.{k} {_fmt(v)}" for k, v in value.items() if not isinstance(v, (Mapping, list))]
        elif not isinstance(value, list) or len(value) <= 8:
            scalars.append(f"{key} {_fmt(value)}")
    items = scalars + nested
    shown = items[:_EVIDENCE_ITEMS]
    text = ", ".join(shown) + (f", ... ({len(items) - len(shown)} more in the JSON)" if len(items) > len(shown) else "")
    if isinstance(window, Mapping) and window.get("steps") is not None:
        span = (f"steps {window.get('first_step')}-{window.get('last_step')}, "
                if window.get("first_step") is not None else "")
        text += f"; window: {span}{window.get('steps')} steps"
    return text


def verdict_line(verdict: Mapping[str, Any]) -> str:
    """``NAME (severity, score 0.34, rank 1): message``: a verdict in one line."""
    details = [str(verdict.get("severity"))]
    if isinstance(verdict.get("score"), (int, float)):
        details.append(f"score {verdict['score']:.3g}")
    ranks = list(verdict.get("ranks") or ())
    if ranks:
        details.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}")
    return f"{verdict.get('name')} ({', '.join(details)}): {verdict.get('message')}"


def diagnosis_lines(diagnosis: Mapping[str, Any] | None) -> list[str]:
    """The text summary's diagnosis: the primary verdict with its evidence and next step, then
    the other findings (step time: warn and crit only), one line each."""
    if not isinstance(diagnosis, Mapping):
        return []
    primary = diagnosis.get("primary")
    if not isinstance(primary, Mapping):
        return [f"diagnosis: not available ({diagnosis.get('error') or 'no verdict'})"]
    lines = [f"diagnosis {verdict_line(primary)}"]
    if isinstance(primary.get("evidence"), Mapping) and primary["evidence"]:
        lines.append(f"  evidence: {evidence_text(primary['evidence'])}")
    if primary.get("next_step"):
        lines.append(f"  next step: {primary['next_step']}")
    # the other step-time findings that matter (warn, crit); every memory and system finding,
    # since each is only made when something is found (a CREEP_EARLY is info, and worth a line)
    others = [v for group in ("step_time", "memory", "system") for v in _verdicts(diagnosis.get(group))
              if (group != "step_time" or v.get("severity") in ("warn", "crit")) and not _same(v, primary)]
    for verdict in others:
        lines.append(f"  also {verdict_line(verdict)}"
                     + (f"; next step: {verdict['next_step']}" if verdict.get("next_step") else ""))
    return lines


def _verdicts(group: Any) -> list[Mapping[str, Any]]:
    return [v for v in group if isinstance(v, Mapping)] if isinstance(group, Sequence) else []


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("name") == b.get("name") and list(a.get("ranks") or ()) == list(b.get("ranks") or ())
