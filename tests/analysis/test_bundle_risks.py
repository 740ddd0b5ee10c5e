"""The diagnose bundle's risks (analysis/bundle_risks.py): memory near its limit is the verdict
policy's one rule, and the module's name no longer hides the engine's ``diagnose``."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

import stepwatch.analysis as analysis
from stepwatch.analysis.bundle_risks import assess_risks
from stepwatch.analysis.verdicts import DEFAULT_POLICY, Diagnosis, diagnose
from tests.support.verdict_rows import CUDA, memory, steps

GIB = 1 << 30


def test_importing_the_bundle_module_leaves_the_lazy_diagnose_the_engine() -> None:
    importlib.import_module("stepwatch.analysis.bundle_risks")
    assert importlib.util.find_spec("stepwatch.analysis.diagnose") is None  # no module of that name
    assert analysis.diagnose is diagnose
    assert isinstance(analysis.diagnose(steps(0, 5)), Diagnosis)


def _near_limit(fraction: float, **policy: float) -> tuple[bool, bool]:
    """(a bundle names MEMORY_NEAR_LIMIT, a run's verdicts name HIGH_PRESSURE) for a device whose
    reserved memory peaks at ``fraction`` of its total."""
    total = 80 * GIB
    peak = int(fraction * total)
    chosen = DEFAULT_POLICY.replace(policy) if policy else DEFAULT_POLICY
    risks = assess_risks([], {"total": float(total), "allocated": [float(GIB), float(peak)]}, chosen)
    rows = steps(0, 60)
    samples = memory(0, rows, [peak] * 60, collector=CUDA, total=total, device=0)
    verdicts = diagnose(rows, samples, policy=chosen).memory
    return any(r["name"] == "MEMORY_NEAR_LIMIT" for r in risks), any(v.name == "HIGH_PRESSURE" for v in verdicts)


@pytest.mark.parametrize(("fraction", "named"), [(0.50, False), (0.91, False), (0.925, True), (0.99, True)])
def test_memory_near_the_limit_is_one_rule_for_bundles_and_verdicts(fraction: float, named: bool) -> None:
    assert _near_limit(fraction) == (named, named)


def test_the_policy_moves_both() -> None:
    assert _near_limit(0.86, pressure_warn=0.85) == (True, True)
    assert _near_limit(0.93, pressure_warn=0.95, pressure_crit=0.98) == (False, False)
    risks = assess_risks([], {"total": 100.0, "allocated": [93.0]})
    assert risks == [{"name": "MEMORY_NEAR_LIMIT", "peak_fraction": 0.93, "threshold": DEFAULT_POLICY.pressure_warn}]
