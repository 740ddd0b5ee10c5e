"""The verdict engine: named findings on a run (why its steps take the time they do, which rank
holds the others back, whether memory creeps), with the numbers behind each.

``diagnose`` (``engine``) judges rows; ``inputs`` reads its arguments from a history store;
``diagnosis`` puts the result into the text summary and ``stepwatch explain``. The step-time
rules live in ``step_time`` over the window of ``step_windows``, the memory and system rules in
``memory`` over the facts of ``memory_facts``, the thresholds in ``policy``, the two result types
in ``model``. docs/verdicts.md publishes every formula and threshold.
"""

from __future__ import annotations

from .engine import diagnose
from .inputs import VerdictInputs, diagnose_store, load_verdict_inputs
from .model import SEVERITY_RANK, Diagnosis, Severity, Verdict
from .policy import DEFAULT_POLICY, NAME_ALIASES, PolicyError, VerdictPolicy, canonical_verdict_name, load_policy

__all__ = ["DEFAULT_POLICY", "NAME_ALIASES", "SEVERITY_RANK", "Diagnosis", "PolicyError", "Severity", "Verdict",
           "VerdictInputs", "VerdictPolicy", "canonical_verdict_name", "diagnose", "diagnose_store", "load_policy",
           "load_verdict_inputs"]
