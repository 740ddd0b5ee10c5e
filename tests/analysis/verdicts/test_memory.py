"""Memory and system verdicts: device memory where a GPU is used, process RSS on a CPU-only run,
each with samples that provoke it and samples that must not."""

from __future__ import annotations

from typing import Any

import pytest

from stepwatch.analysis.verdicts import diagnose
from tests.support.verdict_rows import CPU, CUDA, steps
from tests.support.verdict_rows import memory as samples

MIB = 1 << 20
GIB = 1 << 30


def names(found: Any) -> list[str]:
    return [v.name for v in found]


def cpu_run(count: int, growth_per_step: int, ranks: int = 1, base: int = 2 * GIB) -> tuple[list, list]:
    rows: list[dict[str, Any]] = []
    mem: list[dict[str, Any]] = []
    for rank in range(ranks):
        mine = steps(rank, count)
        rows += mine
        mem += samples(rank, mine, [base + i * growth_per_step + (i % 3) * MIB for i in range(count)])
    return rows, mem


def test_a_cpu_run_that_leaks_is_caught_on_its_rss() -> None:
    rows, mem = cpu_run(300, 5 * MIB)  # 1.5 GiB over the window
    found = diagnose(rows, mem).memory
    assert names(found) == ["CREEP_CONFIRMED"]
    creep = found[0]
    assert creep.severity == "warn" and creep.ranks == (0,)
    assert creep.evidence["memory"] == "rss"
    assert creep.evidence["delta_gib"] == pytest.approx(0.75 * 300 * 5 / 1024, rel=0.05)
    assert "rises" in creep.message


@pytest.mark.parametrize("every", [1, 10])
def test_creep_is_told_per_step_however_often_memory_is_sampled(every: int) -> None:
    # a sampler ticks by time: on a fast loop one sample stands for many steps
    rows = steps(0, 600)
    sampled = [row for row in rows if row["step"] % every == 0]
    found = diagnose(rows, samples(0, sampled, [2 * GIB + row["step"] * 4 * MIB for row in sampled])).memory
    assert names(found) == ["CREEP_CONFIRMED"]
    told = float(found[0].message.split("about ")[1].split(" KiB a step")[0])
    assert told == pytest.approx(4 * 1024, rel=0.05), found[0].message
    assert found[0].evidence["growth_bytes_per_step"] == pytest.approx(4 * MIB, rel=0.05)


def test_a_slow_rise_is_early_creep_only() -> None:
    rows, mem = cpu_run(300, 1 * MIB, ranks=2)  # ~225 MiB between the bands
    found = diagnose(rows, mem).memory
    assert names(found) == ["CREEP_EARLY"] and found[0].severity == "info" and found[0].ranks == (0, 1)


def test_flat_or_noisy_memory_is_no_creep() -> None:
    rows, mem = cpu_run(300, 0)
    assert diagnose(rows, mem).memory == ()
    rows = steps(0, 300)
    noisy = samples(0, rows, [2 * GIB + ((i * 7919) % 13) * MIB for i in range(300)])
    assert diagnose(rows, noisy).memory == ()


def test_memory_waits_for_fifty_steps() -> None:
    rows, mem = cpu_run(49, 50 * MIB)
    assert diagnose(rows, mem).memory == ()


def test_memory_that_rises_then_falls_is_no_creep() -> None:
    rows = steps(0, 300)
    values = [2 * GIB + min(i, 300 - i) * 8 * MIB for i in range(300)]
    assert diagnose(rows, samples(0, rows, values)).memory == ()


def gpu(ranks: dict[int, float], total: int = 80 * GIB, count: int = 100) -> tuple[list, list]:
    rows: list[dict[str, Any]] = []
    mem: list[dict[str, Any]] = []
    for rank, fraction in ranks.items():
        mine = steps(rank, count)
        rows += mine
        mem += samples(rank, mine, [int(fraction * total)] * count, collector=CUDA, total=total, device=rank)
        mem += samples(rank, mine, [3 * GIB] * count)  # the host side too: the device is judged
    return rows, mem


def test_high_pressure_on_the_device() -> None:
    rows, mem = gpu({0: 0.5, 1: 0.95})
    found = diagnose(rows, mem).memory
    pressure = next(v for v in found if v.name == "HIGH_PRESSURE")
    assert pressure.severity == "warn" and pressure.ranks == (1,)
    assert pressure.evidence["memory"] == "device"
    rows, mem = gpu({0: 0.98})
    assert next(v for v in diagnose(rows, mem).memory if v.name == "HIGH_PRESSURE").severity == "crit"
    rows, mem = gpu({0: 0.6, 1: 0.6})
    assert diagnose(rows, mem).memory == ()


def test_imbalance_needs_skew_and_pressure() -> None:
    rows, mem = gpu({0: 0.4, 1: 0.4, 2: 0.6})
    imbalance = next(v for v in diagnose(rows, mem).memory if v.name == "IMBALANCE")
    assert imbalance.severity == "crit" and imbalance.ranks == (2,)
    assert imbalance.score == pytest.approx(0.5, abs=1e-3)
    rows, mem = gpu({0: 0.04, 1: 0.04, 2: 0.06})  # the same skew on a nearly empty device: noise
    assert diagnose(rows, mem).memory == ()


def test_host_memory_and_process_rss() -> None:
    rows = steps(0, 100)
    total = 64 * GIB
    mem = samples(0, rows, [int(0.85 * total)] * 100, total=total, free=int(0.04 * total))
    found = diagnose(rows, mem).system
    host = next(v for v in found if v.name == "HOST_MEMORY_HIGH")
    assert host.severity == "crit" and host.ranks == (0,)
    rss = next(v for v in found if v.name == "PROCESS_RSS_HIGH")
    assert rss.severity == "warn" and rss.ranks == (0,)
    calm = samples(0, rows, [4 * GIB] * 100, total=total, free=40 * GIB)
    assert diagnose(rows, calm).system == ()


def test_low_gpu_utilisation_where_sampled() -> None:
    rows = steps(0, 100)
    util = [{"rank": 0, "timestamp_ns": r["start_ns"], "device_id": 0, "gpu_util_pct": 12.0} for r in rows[::10]]
    low = diagnose(rows, system=util).system
    assert names(low) == ["GPU_UTILIZATION_LOW"] and low[0].score == pytest.approx(12.0)
    busy = [{**u, "gpu_util_pct": 95.0} for u in util]
    assert diagnose(rows, system=busy).system == ()
    assert diagnose(rows, system=util[:2]).system == ()  # too few samples to say
    assert CPU != CUDA


def test_sparse_step_numbers_cost_nothing_extra() -> None:
    """Step numbers far apart (an importer's ids) are walked as they come, not as a range."""
    rows = steps(0, 300)
    for i, row in enumerate(rows):
        row["step"] = i * 10**12
    mem = samples(0, rows, [2 * GIB + i * 5 * MIB for i in range(300)])
    assert names(diagnose(rows, mem).memory) == ["CREEP_CONFIRMED"]
