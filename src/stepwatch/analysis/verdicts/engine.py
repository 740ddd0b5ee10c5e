"""Named verdicts on a run: why its steps take the time they do, which rank holds the others
back, whether memory creeps. Pure: rows in, verdicts out (no I/O, no torch), deterministic.

The surfaces (final summary, ``explain``, the live aggregator, ``compare``) call ``diagnose``;
``inputs.load_verdict_inputs`` reads its arguments from a history store. The rules live in
``step_time`` and ``memory``, the thresholds in ``policy``; docs/verdicts.md publishes every
formula and threshold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .memory import memory_verdicts, system_verdicts
from .memory_facts import memory_facts
from .model import SEVERITY_RANK, Diagnosis, Severity, Verdict
from .policy import (
    DEFAULT_POLICY,
    NAME_ALIASES,
    PolicyError,
    VerdictPolicy,
    canonical_verdict_name,
    load_policy,
)
from .step_time import pick_primary, step_time_verdicts
from .step_windows import build_window

__all__ = ["DEFAULT_POLICY", "NAME_ALIASES", "SEVERITY_RANK", "Diagnosis", "PolicyError", "Severity", "Verdict",
           "VerdictPolicy", "canonical_verdict_name", "diagnose", "load_policy"]


def diagnose(steps: Iterable[Mapping[str, Any]], memory: Iterable[Mapping[str, Any]] = (),
             system: Iterable[Mapping[str, Any]] = (), *, window: int | None = None,
             policy: VerdictPolicy = DEFAULT_POLICY, expected_ranks: Sequence[int] = (),
             barrier_wait_ns: Mapping[int, float] | None = None) -> Diagnosis:
    """The verdicts on ``steps`` (rows of the history's ``steps`` table, every rank), ``memory``
    (telemetry ``sample`` rows: rank, timestamp_ns, collector, device_id, allocated, reserved,
    free, total, host) and ``system`` samples (rank, timestamp_ns, device_id, gpu_util_pct).

    ``window``: the last N steps completed on every rank (live), None: all of them.
    ``expected_ranks``: the ranks the run has, so a rank with no step at all is named in
    ``INCOMPLETE_DATA``. ``barrier_wait_ns``: per rank, the time it waited in ``dist.barrier()``
    between the window's steps (the ``stepwatch.barrier_wait_ms`` marks), which tells the rank
    that works between steps from the ones that wait for it. Memory and system samples are read
    over the window's time span.
    ``steps`` may be ``StepColumns`` (what ``load_verdict_inputs`` gives) or row mappings; both are
    reduced on numpy arrays.
    """
    step_window = build_window(steps, window, expected_ranks=expected_ranks)
    step_time = step_time_verdicts(step_window, policy, barrier_wait_ns)
    primary = pick_primary(step_time, step_window)
    facts = memory_facts(memory, step_window)
    memory_found = [v for v in memory_verdicts(step_window, facts, policy) if policy.enabled(v.name)]
    system_found = [v for v in system_verdicts(step_window, facts, system, policy) if policy.enabled(v.name)]
    return Diagnosis(primary, tuple(step_time), tuple(memory_found), tuple(system_found))
