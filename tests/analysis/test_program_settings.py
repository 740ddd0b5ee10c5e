"""Advice that names the program's settings (analysis/program_settings.py), and the watchdog's
rule that a program's own loss or gradient norm wins over the inferred one (analysis/alerts.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stepwatch.analysis.alerts import AlertRules
from stepwatch.analysis.program_settings import with_settings
from stepwatch.analysis.verdicts.model import Diagnosis, Verdict

LOADER = {"class": "DataLoader", "batch_size": 16, "num_workers": 2, "pin_memory": False, "prefetch_factor": 2,
          "persistent_workers": False, "dataset": "Numbers", "dataset_len": 960, "host_cpus": 2, "usable_cpus": 2}


def verdict(name: str) -> Verdict:
    return Verdict(name, "crit", 0.7, (0,), "input takes 70% of step time", "more DataLoader workers", {"share": 0.7})


def diagnosis(name: str) -> Diagnosis:
    found = verdict(name)
    return Diagnosis(found, (found,))


def test_input_bound_names_num_workers_and_the_cores() -> None:
    advised = with_settings(diagnosis("INPUT_BOUND"), {0: {"dataloaders": [LOADER], "optimizers": [], "h2d": []}})
    assert advised.primary.next_step.startswith("num_workers is 2 on a 2-core machine: more workers will not help")
    assert advised.primary.next_step.endswith("In general: more DataLoader workers")
    assert advised.primary.evidence["program"]["dataloader"]["num_workers"] == 2
    assert "num_workers 2" in advised.primary.evidence["settings"] and "2 cores" in advised.primary.evidence["settings"]
    assert advised.step_time[0] == advised.primary


def test_no_workers_says_so_and_how_many_the_machine_has() -> None:
    loader = {**LOADER, "num_workers": 0, "host_cpus": 8, "usable_cpus": 8}
    advised = with_settings(diagnosis("INPUT_BOUND"), {0: {"dataloaders": [loader], "optimizers": [], "h2d": []}})
    assert advised.primary.next_step.startswith("num_workers is 0 on a 8-core machine")
    assert "up to about 7" in advised.primary.next_step


def test_h2d_bound_names_blocking_copies_and_pin_memory() -> None:
    copies = [{"non_blocking": False, "source_pinned": False, "dtype": "torch.float32"}]
    advised = with_settings(diagnosis("H2D_BOUND"), {0: {"dataloaders": [LOADER], "optimizers": [], "h2d": copies}})
    step = advised.primary.next_step
    assert "every copy to the device seen was blocking" in step and "pin_memory is False on the DataLoader" in step


def test_compute_bound_names_an_unfused_optimizer_on_a_device() -> None:
    opt = {"class": "AdamW", "fused": None, "foreach": None, "param_device": "cuda", "lr": 1e-3}
    advised = with_settings(diagnosis("COMPUTE_BOUND"), {0: {"dataloaders": [], "optimizers": [opt], "h2d": []}})
    assert advised.primary.next_step.startswith("AdamW runs with fused=None, foreach=None (torch picks foreach here)")


def test_without_settings_the_diagnosis_is_unchanged() -> None:
    plain = diagnosis("INPUT_BOUND")
    assert with_settings(plain, {}) is plain
    other = diagnosis("BETWEEN_STEPS")
    assert with_settings(other, {0: {"dataloaders": [LOADER], "optimizers": [], "h2d": []}}) == other


# -- the watchdog: the program's own value wins ------------------------------------------------

INFERRED = {"source": "backward root", "inferred": True}
values = st.lists(st.tuples(st.booleans(), st.sampled_from([0.5, 1.0, float("nan")])), max_size=20)


def nonfinite_alerts(sequence: list[tuple[bool, float]]) -> list[Any]:
    rules = AlertRules()
    for step, (inferred, value) in enumerate(sequence):
        rules.observe_mark(0, "loss", value, step=step, key=f"s{step}-{inferred}", ts=float(step), at=float(step),
                           attrs=INFERRED if inferred else None)
    return [a for a in rules.check(100.0) if a.kind == "NONFINITE"]


@given(values)
def test_an_inferred_value_counts_only_until_the_program_logs_its_own(sequence: list[tuple[bool, float]]) -> None:
    first_own = next((i for i, (inferred, _) in enumerate(sequence) if not inferred), len(sequence))
    counted = [v for i, (inferred, v) in enumerate(sequence) if not inferred or i < first_own]
    found = nonfinite_alerts(sequence)
    # a NaN among the counted values alerts unless a finite value came after the last NaN (it cleared)
    last_nan = max((i for i, v in enumerate(counted) if v != v), default=None)
    expected = last_nan is not None and all(v != v for v in counted[last_nan:])
    assert bool(found) == expected


def test_a_finite_user_loss_wins_over_a_nan_inferred_one_on_the_same_step() -> None:
    rules = AlertRules()
    rules.observe_mark(0, "loss", 0.5, step=3, key="a", ts=1.0, at=1.0)
    rules.observe_mark(0, "loss", float("nan"), step=3, key="a", ts=1.0, at=1.0, attrs=INFERRED)
    assert rules.check(10.0) == []


def test_a_scalers_skipped_step_is_no_nonfinite_gradient_norm() -> None:
    rules = AlertRules()
    attrs = json.loads('{"source": "clip_grad_norm_", "inferred": true, "scaler": true}')
    rules.observe_mark(0, "grad_norm", "inf", step=0, key="a", ts=1.0, at=1.0, attrs=attrs)
    assert rules.check(10.0) == []
    rules.observe_mark(0, "grad_norm", "inf", step=1, key="b", ts=2.0, at=2.0, attrs={**attrs, "scaler": False})
    (alert,) = rules.check(20.0)
    assert alert.kind == "NONFINITE" and "(inferred: clip_grad_norm_)" in alert.message


def test_versions_come_from_the_lowest_rank_that_recorded_them(tmp_path: Any) -> None:
    from stepwatch.analysis.program_settings import session_versions
    from stepwatch.store.sqlite import SqliteStore

    def mark(rank: int, attrs: Any, ts: int) -> dict[str, Any]:
        return {"session_id": "s", "rank": rank, "mark_id": f"m{rank}{ts}", "span_id": None,
                "name": "stepwatch.versions", "value_type": "str", "value_num": None, "value_text": "2.5",
                "ts_ns": ts, "kind": "summary", "attrs": attrs}

    with SqliteStore(tmp_path / "history.sqlite") as store:
        store.append_many({"marks": [mark(3, {"torch": "2.4", "cuda": None}, 1), mark(1, {"torch": "2.5", "cuda": "12.4",
                                                                                          "python": "3.11.2"}, 2)]})
        assert session_versions(store, "s") == {"torch": "2.5", "cuda": "12.4", "python": "3.11.2"}
        assert session_versions(store, "other") == {}
        store.append_many({"marks": [mark(0, {"torch": "2.6", "cuda": None}, 3)]})
        assert session_versions(store, "s") == {"torch": "2.6"}  # a CPU build names no CUDA
