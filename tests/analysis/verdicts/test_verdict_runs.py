"""Each verdict provoked by a real training run under ``stepwatch run`` (CPU, gloo, 1-2 ranks), a
clean run that must provoke none, and the commands that read the verdicts back."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from stepwatch.analysis.markers import derive_verdict_markers
from tests.support import run_stepwatch as stepwatch
from tests.support.web_runs import track_run

from .conftest import Run

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

# 20 ms of sleep in each forward: a loaded machine's timing noise (~0.5 ms a step) stays well
# inside compare's +/- 3 % band, so the same script twice is EQUIVALENT
STEP = ("--steps", "150", "--forward-ms", "20")
CLEAN = ("clean", *STEP)
STEADY = ("--steps", "60", "--forward-ms", "150")
SLOW_LOADER = ("slow-loader", *STEP, "--slow-loader-ms", "15")
STRAGGLERS = {"STRAGGLER", "INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER"}


def findings(diagnosis: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for group in ("step_time", "memory", "system") for v in diagnosis[group]]


def serious(diagnosis: dict[str, Any]) -> list[tuple[str, str]]:
    return [(v["name"], v["severity"]) for v in [diagnosis["primary"], *findings(diagnosis)]
            if v["severity"] in ("warn", "crit")]


def test_a_slow_loader_is_input_bound_in_the_summary_the_text_and_explain(runs: Callable[..., Run]) -> None:
    run = runs(*SLOW_LOADER)
    summary = run.summary
    assert summary["schema_version"] == "1.1"
    primary = summary["diagnosis"]["primary"]
    assert primary["name"] == "INPUT_BOUND" and primary["severity"] in ("warn", "crit"), primary
    assert primary["ranks"] == [0] and primary["next_step"] and primary["evidence"]["share"] >= 0.2
    assert {"overall", "per_rank", "memory_peaks", "drops", "outcome"} <= set(summary)  # every 1.0 field kept
    text = (run.out / "final_summary.txt").read_text().splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith("diagnosis "))
    assert text[first].startswith("diagnosis INPUT_BOUND (")
    assert first <= 2 and text[first + 1].startswith("  evidence: ") and text[first + 2].startswith("  next step: ")
    assert first < next(i for i, line in enumerate(text) if line.startswith("steps "))
    assert "diagnosis INPUT_BOUND (" in run.proc.stdout  # run prints the summary, diagnosis first
    explained = run.explain()
    assert explained["diagnosis"]["primary"]["name"] == "INPUT_BOUND" and explained["source"] == "history.sqlite"
    assert explained["diagnosis"] == summary["diagnosis"]  # same rows, same verdicts
    text_summary = stepwatch("summary", str(run.out), cwd=run.out.parent)
    assert text_summary.stdout.splitlines()[2].startswith("diagnosis INPUT_BOUND (")


def test_a_slow_rank_is_named_and_only_that_rank(ddp_runs: dict[str, Run]) -> None:
    run = ddp_runs["straggler"]
    diagnosis = run.diagnosis
    primary = diagnosis["primary"]
    assert primary["name"] in STRAGGLERS and primary["severity"] in ("warn", "crit"), primary
    assert primary["ranks"] == [1]
    assert primary["evidence"]["held_back"] == [0]
    for verdict in findings(diagnosis):
        if verdict["severity"] in ("warn", "crit"):
            assert 0 not in verdict["ranks"], verdict
    # a live verdict, where one came (300 steps are ~2 s: on a machine busy with other tests the
    # live thread may not judge the run twice, as a change must hold; the loader test below
    # asserts that one comes), names rank 1 too
    live = [line for line in run.proc.stderr.splitlines() if line.startswith("[stepwatch] verdict ")]
    assert all(" rank 1)" in line for line in live if "(info" not in line), live


def test_a_growing_list_of_tensors_is_memory_creep_on_process_rss(runs: Callable[..., Run]) -> None:
    run = runs("creep", "--steps", "300", "--forward-ms", "5", "--leak-mb", "1", interval_ms=100)
    creep = [v for v in run.diagnosis["memory"] if v["name"] in ("CREEP_EARLY", "CREEP_CONFIRMED")]
    assert creep and creep[0]["ranks"] == [0] and creep[0]["evidence"]["memory"] == "rss", run.diagnosis["memory"]
    assert creep[0]["evidence"]["delta_gib"] > 0.1
    assert any(line.startswith(f"  also {creep[0]['name']} (") for line in run.proc.stdout.splitlines())


# rank 1 keeps 2 MiB a step, rank 0 nothing: ~400 MiB more on rank 1 after 200 steps
ONE_RANK_LEAKS = ("one-rank-leaks", "--steps", "200", "--forward-ms", "3", "--leak-mb", "2", "--leak-rank", "1")


def test_memory_kept_by_one_rank_is_imbalance_and_creep_naming_that_rank(runs: Callable[..., Run]) -> None:
    run = runs(*ONE_RANK_LEAKS, ranks=2, interval_ms=100)
    memory = {v["name"]: v for v in run.diagnosis["memory"]}
    creep = memory.get("CREEP_CONFIRMED") or memory.get("CREEP_EARLY")
    assert creep is not None and creep["ranks"] == [1], memory
    # told per step of training, not per sample (the sampler ticked every ~17 steps here)
    assert creep["evidence"]["growth_bytes_per_step"] == pytest.approx(2 * 2**20, rel=0.25), creep
    # the skew is real (rank 1 holds about twice rank 0's RSS) but on a 2-core CI machine it is a few
    # % of the host's memory, under IMBALANCE's 30 % floor; lowered, the rule names rank 1
    assert "IMBALANCE" not in memory
    explained = run.explain("--set", "imbalance_pressure_warn=0.001", "--set", "imbalance_pressure_crit=0.002")
    imbalance = [v for v in explained["diagnosis"]["memory"] if v["name"] == "IMBALANCE"]
    assert imbalance and imbalance[0]["ranks"] == [1] and imbalance[0]["evidence"]["skew"] >= 0.2, explained


def test_the_host_memory_verdicts_read_a_real_runs_samples(runs: Callable[..., Run]) -> None:
    # a CI machine's memory is never near full: the thresholds are lowered to what any run reaches,
    # so that the collector's real RSS, host totals and host names reach each rule
    run = runs(*ONE_RANK_LEAKS, ranks=2, interval_ms=100)
    assert not {"HIGH_PRESSURE", "HOST_MEMORY_HIGH", "PROCESS_RSS_HIGH"} & {v["name"] for v in findings(run.diagnosis)}
    low = ("pressure_warn=0.001", "pressure_crit=0.002", "host_memory_warn=0.001", "host_memory_crit=0.002",
           "process_rss_warn=0.001", "process_rss_crit=0.002")
    explained = run.explain(*(arg for setting in low for arg in ("--set", setting)))
    found = {v["name"]: v for v in findings(explained["diagnosis"])}
    assert found["HIGH_PRESSURE"]["evidence"]["memory"] == "rss" and found["HIGH_PRESSURE"]["ranks"] == [0, 1]
    assert found["HOST_MEMORY_HIGH"]["ranks"] == [0, 1] and 0 < found["HOST_MEMORY_HIGH"]["evidence"]["used_fraction"] < 1
    rss = found["PROCESS_RSS_HIGH"]["evidence"]["rss_fraction_per_rank"]
    assert rss["1"] > rss["0"] > 0, rss  # the rank that keeps its tensors holds more


def test_a_sleep_after_each_step_is_between_steps(runs: Callable[..., Run]) -> None:
    run = runs("between", "--steps", "200", "--forward-ms", "3", "--sleep-after-step-ms", "5")
    primary = run.diagnosis["primary"]
    assert primary["name"] == "BETWEEN_STEPS" and primary["severity"] in ("warn", "crit"), primary
    assert primary["evidence"]["share_of_wall"] > 0.3


def test_the_rank_that_works_between_steps_is_named_and_the_one_waiting_at_a_barrier_is_not(
        runs: Callable[..., Run]) -> None:
    run = runs("barrier", "--steps", "150", "--forward-ms", "2", "--checkpoint-ms", "6", ranks=2)
    between = [v for v in findings(run.diagnosis) if v["name"] == "BETWEEN_STEPS"]
    assert between and between[0]["severity"] in ("warn", "crit") and between[0]["ranks"] == [0], run.diagnosis
    assert "while rank 1 waits " in between[0]["message"] and "dist.barrier()" in between[0]["message"]
    waited = between[0]["evidence"]["barrier_wait_ms_per_step"]
    assert waited["1"] >= 4.0 and waited["0"] < waited["1"] / 2, waited
    assert between[0]["next_step"].startswith("on rank 0: ")


def test_host_work_between_forward_and_backward_is_residual_heavy(runs: Callable[..., Run]) -> None:
    run = runs("residual", "--steps", "150", "--forward-ms", "3", "--host-work-ms", "6")
    primary = run.diagnosis["primary"]
    assert primary["name"] == "RESIDUAL_HEAVY" and primary["severity"] in ("warn", "crit"), primary
    assert primary["ranks"] == [0] and primary["evidence"]["share"] > 0.3
    assert "loss computation" in primary["next_step"] and "stepwatch.scope()" in primary["next_step"]
    # the sleep is host time inside the step: neither a phase nor time between steps
    assert "BETWEEN_STEPS" not in {v["name"] for v in findings(run.diagnosis)}


def test_a_clean_balanced_run_has_no_warn_or_crit_verdict(runs: Callable[..., Run]) -> None:
    run = runs(*CLEAN)
    assert serious(run.diagnosis) == [], run.diagnosis
    assert run.diagnosis["primary"]["name"] in ("BALANCED", "COMPUTE_BOUND")
    live = [line for line in run.proc.stderr.splitlines() if line.startswith("[stepwatch] verdict ")]
    assert all("(info" in line for line in live), live
    rows = _query(run.out, "SELECT severity FROM verdicts")
    assert all(severity == "info" for (severity,) in rows)


def test_a_clean_two_rank_ddp_run_names_no_straggler(ddp_runs: dict[str, Run]) -> None:
    run = ddp_runs["clean"]
    assert serious(run.diagnosis) == [], run.diagnosis
    assert not any(v["name"] in STRAGGLERS for v in findings(run.diagnosis))
    live = [line for line in run.proc.stderr.splitlines() if line.startswith("[stepwatch] verdict ")]
    assert all("(info" in line for line in live), live


def test_a_loader_turning_slow_mid_run_prints_a_live_verdict_and_stores_it(runs: Callable[..., Run]) -> None:
    # a forward of 4 ms keeps the first 200 steps' fetch (about 1 ms on a busy machine) under INPUT_BOUND's 10 %
    run = runs("live", "--steps", "600", "--forward-ms", "4", "--slow-loader-ms", "8", "--slow-loader-after", "200",
               STEPWATCH_VERDICT_INTERVAL_S="0.5")
    lines = [line for line in run.proc.stderr.splitlines() if line.startswith("[stepwatch] verdict INPUT_BOUND (")]
    assert len(lines) == 1, run.proc.stderr
    assert "next step: num_workers is 0 on a " in lines[0] and "In general: more DataLoader workers" in lines[0]
    rows = _query(run.out, "SELECT session_id, ts_ns, step, window_steps, name, severity, score, ranks, message, "
                           "next_step, evidence FROM verdicts WHERE name = 'INPUT_BOUND'")
    assert len(rows) == 1
    session_id, ts_ns, step, window, name, severity, score, ranks, message, next_step, evidence = rows[0]
    assert step > 200 and window == 100 and json.loads(ranks) == [0] and json.loads(evidence)["share"] >= 0.2
    assert message in lines[0] and session_id == run.summary["session_id"]
    markers = derive_verdict_markers([{"session_id": session_id, "ts_ns": ts_ns, "name": name, "severity": severity,
                                       "ranks": ranks, "message": message, "step": step}])
    assert markers[0].kind == "verdict" and markers[0].rank == 0 and markers[0].label.startswith("verdict INPUT_BOUND")
    stats = json.loads((run.out / "aggregator_stats.json").read_text())["live_verdicts"]
    assert stats["evaluations"] >= 2 and stats["errors"] == 0


def test_explain_a_track_run_without_history(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    out = track_run(tmp_path_factory)
    assert not (out / "history.sqlite").exists()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    explained = stepwatch("explain", str(out), "--json", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    result = json.loads(explained.stdout)
    assert result["source"].startswith("the run's artifacts")
    assert result["diagnosis"]["primary"]["name"] == "INPUT_BOUND"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written into the run
    text = stepwatch("explain", str(out), "--window", "50", cwd=tmp_path)
    assert text.returncode == 0 and "over the last 50 steps of every rank" in text.stdout
    assert text.stdout.splitlines()[1].startswith("diagnosis INPUT_BOUND (")


def test_compare_exit_codes_on_real_runs(runs: Callable[..., Run], tmp_path: Path) -> None:
    clean, slow = runs(*CLEAN), runs(*SLOW_LOADER)
    worse = stepwatch("compare", str(clean.out), str(slow.out), "--max-step-time-regression-pct", "10", "--json",
                      cwd=tmp_path)
    assert worse.returncode == 4, worse.stdout + worse.stderr
    result = json.loads(worse.stdout)
    assert result["verdict"]["verdict"] == "REGRESSION" and result["verdict"]["regression_past_threshold"]
    assert {r["metric"] for r in result["metrics"]} >= {"step_ms.median", "phase_share.data_load"}
    lenient = stepwatch("compare", str(clean.out), str(slow.out), cwd=tmp_path)
    assert lenient.returncode == 0 and "verdict REGRESSION: " in lenient.stdout  # no threshold: said, not failed


def test_compare_the_same_script_twice_is_equivalent(runs: Callable[..., Run], tmp_path: Path) -> None:
    # 150 ms of sleep a step: a busy machine's noise (late wake-ups, slower compute: 2.3 ms a
    # step at load 12, 3.7 % of a 60 ms step) stays inside the +/- 3 % band; both runs at once,
    # so that they train under the same load (back to back, one ran 3 % slower)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda name: runs(name, *STEADY), ("steady-a", "steady-b"))
    same = stepwatch("compare", str(first.out), str(second.out), "--max-step-time-regression-pct", "10", "--json",
                     cwd=tmp_path)
    assert same.returncode == 0, same.stdout
    assert json.loads(same.stdout)["verdict"]["verdict"] == "EQUIVALENT", json.loads(same.stdout)["verdict"]


def test_compare_too_few_steps_is_inconclusive_and_bad_input_exit_2(runs: Callable[..., Run], tmp_path: Path) -> None:
    clean = runs(*CLEAN)
    short = runs("short", "--steps", "10", "--forward-ms", "20")
    few = stepwatch("compare", str(clean.out), str(short.out), "--json", cwd=tmp_path)
    assert few.returncode == 3 and "too few steps in B: 10" in json.loads(few.stdout)["verdict"]["reasons"][0]
    bad = stepwatch("compare", str(clean.out), str(tmp_path), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_explain_bad_input_is_one_error_line_and_exit_2(runs: Callable[..., Run], tmp_path: Path) -> None:
    run = runs(*CLEAN)
    empty = tmp_path / "empty"
    empty.mkdir()
    damaged = tmp_path / "damaged"
    shutil.copytree(run.out, damaged)
    (damaged / "history.sqlite").write_bytes(b"this is not a database" * 100)
    for args in ([str(empty)], [str(tmp_path / "missing")], [str(damaged)], [str(run.out), "--session", "nope"],
                 [str(run.out), "--set", "no_such_key=1"], [str(run.out), "--policy", str(tmp_path / "none.toml")]):
        proc = stepwatch("explain", *args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)


def test_summary_takes_a_policy(runs: Callable[..., Run], tmp_path: Path) -> None:
    run = runs(*SLOW_LOADER)
    relaxed = stepwatch("summary", str(run.out), "--json", "--set", "input_share_warn=0.95",
                        "--set", "input_share_crit=0.99", cwd=tmp_path)
    assert relaxed.returncode == 0, relaxed.stderr
    assert json.loads(relaxed.stdout)["diagnosis"]["primary"]["name"] != "INPUT_BOUND"
    assert run.summary["diagnosis"]["primary"]["name"] == "INPUT_BOUND"  # the written summary stands


def _query(out: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"{(out / 'history.sqlite').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()
