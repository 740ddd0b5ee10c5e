"""Heartbeat files (spec: heartbeat-jsonl.md): the record, the writer, the reader, and what the
runtime writes into ``heartbeat_rank<N>.jsonl`` while a program runs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from stepwatch.artifacts.heartbeat import HeartbeatWriter, heartbeat_filename, heartbeat_record, read_heartbeat
from stepwatch.errors import ArtifactError
from tests.support import clean_env

SPEC_FIELDS = ["ts", "iso", "pid", "rank", "step", "msg"]


def run_py(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=30)


# -- the record ----------------------------------------------------------------------------------


def test_record_has_the_spec_fields_in_order() -> None:
    ts = 1692720000.123456
    record = heartbeat_record(ts=ts, pid=12345, rank=2, step=7, msg="boot", phase="start")
    assert list(record)[:6] == SPEC_FIELDS
    assert record == {"ts": 1692720000.123456, "iso": "2023-08-22T16:00:00.123Z", "pid": 12345, "rank": 2,
                      "step": 7, "msg": "boot", "phase": "start"}
    parsed = datetime.strptime(record["iso"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert abs(parsed.timestamp() - ts) < 1e-3


def test_progress_record_with_training_metrics() -> None:
    record = heartbeat_record(ts=1.0, pid=1, rank=0, step=100, msg="progress", loss=3.2451, toks_per_s=1245.0,
                              dt_fetch_s=0.045, grad_norm=1.23, gpu_mem_alloc=5120, gpu_mem_reserved=6144)
    assert record["loss"] == 3.2451 and record["toks_per_s"] == 1245.0
    assert record["dt_fetch_s"] == 0.045 and record["grad_norm"] == 1.23
    assert (record["gpu_mem_alloc"], record["gpu_mem_reserved"]) == (5120, 6144)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_become_null_and_lines_stay_strict_json(tmp_path: Path, bad: float) -> None:
    writer = HeartbeatWriter(tmp_path, 0)
    writer.write(heartbeat_record(ts=time.time(), pid=1, rank=0, step=3, msg="progress", loss=bad, grad_norm=bad,
                                  toks_per_s=10.0, dt_fetch_s=None))
    writer.close()
    line = (tmp_path / "heartbeat_rank0.jsonl").read_text().strip()

    def reject(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    record = json.loads(line, parse_constant=reject)
    assert record["loss"] is None and record["grad_norm"] is None
    assert record["toks_per_s"] == 10.0
    assert "dt_fetch_s" not in record  # None extras are left out


# -- writer and reader ---------------------------------------------------------------------------


def test_writer_and_reader_round_trip(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path / "run", 3)
    assert writer.path == tmp_path / "run" / "heartbeat_rank3.jsonl" == tmp_path / "run" / heartbeat_filename(3)
    records = [heartbeat_record(ts=1000.0 + i, pid=9, rank=3, step=i, msg="progress", loss=1.0 / (i + 1),
                                custom_field={"x": i}) for i in range(5)]
    for r in records:
        writer.write(r)
    writer.flush()
    assert read_heartbeat(writer.path) == records  # unknown fields kept
    writer.close()
    writer = HeartbeatWriter(tmp_path / "run", 3)  # reopening appends
    writer.write(heartbeat_record(ts=2000.0, pid=9, rank=3, step=5, msg="stop"))
    writer.close()
    assert [r["step"] for r in read_heartbeat(writer.path)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_rotation_by_size_keeps_the_newest_files(tmp_path: Path, keep: int) -> None:
    writer = HeartbeatWriter(tmp_path, 0, max_bytes=600, keep=keep)
    for step in range(100):
        writer.write(heartbeat_record(ts=1000.0 + step, pid=1, rank=0, step=step, msg="progress", loss=0.5))
    writer.close()
    base = tmp_path / "heartbeat_rank0.jsonl"
    rotated = [base.with_name(f"{base.name}.{i}") for i in range(1, keep + 1)]
    assert all(p.is_file() for p in rotated)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([base.name, *(p.name for p in rotated)])
    for path in [base, *rotated]:
        assert 0 < path.stat().st_size <= 600
    # oldest (.keep) .. .1 .. current: one contiguous run of the newest steps, ending with the last
    steps = [r["step"] for path in [*reversed(rotated), base] for r in read_heartbeat(path)]
    assert steps == list(range(steps[0], 100))
    assert steps[0] > 0  # older records were rotated away


def test_reader_ignores_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat_rank0.jsonl"
    good = [heartbeat_record(ts=1.0 + i, pid=1, rank=0, step=i, msg="heartbeat") for i in range(3)]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + b'{"ts": 4.0, "iso": "2023-')
    assert read_heartbeat(path) == good


def test_a_writer_resuming_after_a_crash_cuts_the_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat_rank0.jsonl"
    good = [heartbeat_record(ts=1.0 + i, pid=1, rank=0, step=i, msg="heartbeat") for i in range(2)]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + b'{"ts": 3.0, "iso": "2023-')
    writer = HeartbeatWriter(tmp_path, 0)  # the resumed run appends to the same file
    resumed = heartbeat_record(ts=10.0, pid=2, rank=0, step=2, msg="boot")
    writer.write(resumed)
    writer.close()
    assert read_heartbeat(path) == [*good, resumed]


def test_reader_rejects_a_malformed_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat_rank0.jsonl"
    path.write_text('{"ts": 1.0, "rank": 0, "step": 0, "msg": "boot"}\n{"ts": 2.0, "ra\n'
                    '{"ts": 3.0, "rank": 0, "step": 1, "msg": "heartbeat"}\n')
    with pytest.raises(ArtifactError) as caught:
        read_heartbeat(path)
    assert caught.value.line == 2
    assert caught.value.path == str(path)


@pytest.mark.parametrize("field", ["ts", "rank", "step", "msg"])
def test_missing_required_field_names_file_line_and_field(tmp_path: Path, field: str) -> None:
    path = tmp_path / "heartbeat_rank1.jsonl"
    ok = heartbeat_record(ts=1.0, pid=1, rank=1, step=0, msg="boot")
    broken = dict(heartbeat_record(ts=2.0, pid=1, rank=1, step=1, msg="heartbeat"))
    del broken[field]
    path.write_text(json.dumps(ok) + "\n" + json.dumps(broken) + "\n" + json.dumps(ok) + "\n")
    with pytest.raises(ArtifactError) as caught:
        read_heartbeat(path)
    error = caught.value
    assert (error.path, error.line, error.field) == (str(path), 2, f"$.{field}")
    assert str(path) in str(error) and ":2" in str(error) and field in str(error)


def test_wrong_types_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat_rank0.jsonl"
    path.write_text('{"ts": "yesterday", "rank": 0, "step": 0, "msg": "boot"}\n')
    with pytest.raises(ArtifactError) as caught:
        read_heartbeat(path)
    assert caught.value.line == 1


def test_missing_file_is_an_artifact_error(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError) as caught:
        read_heartbeat(tmp_path / "heartbeat_rank0.jsonl")
    assert "heartbeat_rank0.jsonl" in str(caught.value)


# -- what the runtime writes ---------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("interval", [0.05, 1.0], ids=["fast-sampling", "default-sampling"])
def test_runtime_writes_boot_then_time_cadence_heartbeats_without_progress_calls(
    tmp_path: Path, interval: float
) -> None:
    """The heartbeat cadence is its own: sampling once a second must not slow it down."""
    run = tmp_path / "run"
    proc = run_py(
        """
        import os, sys, time, stepwatch
        stepwatch.init(out=sys.argv[1], interval=float(sys.argv[2]), heartbeat_interval=0.2)
        time.sleep(1.0)
        stepwatch.shutdown()
        print(os.getpid())
        """,
        tmp_path, str(run), str(interval),
    )
    assert proc.returncode == 0, proc.stderr
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    msgs = [b["msg"] for b in beats]
    assert msgs[0] == "boot" and beats[0].get("phase") == "start"
    assert msgs[-1] == "stop" and beats[-1]["status"] == "completed"
    assert 3 <= msgs.count("heartbeat") <= 8, msgs
    for b in beats:
        assert list(b)[:6] == SPEC_FIELDS
        assert b["pid"] == int(proc.stdout) and b["rank"] == 0 and b["step"] == 0
        assert b["iso"].endswith("Z")
    ts = [b["ts"] for b in beats if b["msg"] == "heartbeat"]
    assert all(0.1 < b - a < 0.5 for a, b in zip(ts, ts[1:])), ts


@pytest.mark.real
def test_heartbeat_file_is_flushed_while_the_process_runs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = """
        import sys, time, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.5, heartbeat_interval=0.2)
        print("READY", flush=True)
        time.sleep(20)
    """
    with subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(run)], cwd=tmp_path, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
            ready = time.monotonic()
            path = run / "heartbeat_rank0.jsonl"
            msgs: list[str] = []
            while time.monotonic() - ready < 1.5:
                msgs = [b["msg"] for b in read_heartbeat(path)] if path.exists() else []
                if "heartbeat" in msgs:
                    break
                time.sleep(0.05)
            assert proc.poll() is None  # still running: what we read was flushed, not closed
            assert msgs[:1] == ["boot"] and "heartbeat" in msgs, msgs
            assert time.monotonic() - ready < 1.5
        finally:
            proc.terminate()
            proc.communicate(timeout=15)


@pytest.mark.real
def test_progress_records_and_their_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, time, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=0.1)
        stepwatch.progress(10, loss=2.5, toks_per_s=1200.0, dt_fetch_s=0.04, grad_norm=float("nan"))
        stepwatch.progress(11, loss=2.4, toks_per_s=1250.0, dt_fetch_s=0.03, grad_norm=1.5)
        time.sleep(0.3)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    text = (run / "heartbeat_rank0.jsonl").read_text()
    assert "NaN" not in text
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    progress = [b for b in beats if b["msg"] == "progress"]
    assert [(p["step"], p["loss"], p["toks_per_s"], p["dt_fetch_s"], p["grad_norm"]) for p in progress] == [
        (10, 2.5, 1200.0, 0.04, None), (11, 2.4, 1250.0, 0.03, 1.5)]
    later = [b for b in beats if b["msg"] in ("heartbeat", "stop") and b["ts"] > progress[-1]["ts"]]
    assert later and all(b["step"] == 11 for b in later)  # liveness records carry the latest step
    assert all("gpu_mem_alloc" not in b for b in beats)  # no CUDA here


@pytest.mark.real
def test_numpy_values_in_progress_records(tmp_path: Path) -> None:
    """``loss=np.float32(...)``, ``step=np.int64(...)``: written as numbers, nothing lost."""
    pytest.importorskip("numpy")
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, time, numpy as np, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=0.1)
        stepwatch.progress(np.int64(3), loss=np.float32(1.5), toks_per_s=np.float64(10.0), grad_norm=np.float32("nan"))
        stepwatch.progress(4, loss=0.5, weights=np.zeros(3))
        time.sleep(0.3)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    progress = [b for b in beats if b["msg"] == "progress"]
    assert [(p["step"], p["loss"]) for p in progress] == [(3, 1.5), (4, 0.5)]
    assert progress[0]["toks_per_s"] == 10.0 and progress[0]["grad_norm"] is None
    assert isinstance(progress[1]["weights"], str)  # not a scalar: kept readable, the record still written
    assert beats[-1]["msg"] == "stop" and beats[-1]["step"] == 4


@pytest.mark.real
def test_gpu_memory_fields_appear_with_a_cuda_device(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import importlib.machinery, sys, time, types, stepwatch
        from stepwatch.capture.collectors import CollectorHealth
        from stepwatch.capture.collectors.torch_devices import CudaCollector
        MB = 1 << 20
        class Cuda:
            def is_available(self): return True
            def is_initialized(self): return True
            def device_count(self): return 2
            def current_device(self): return 0
            def memory_stats(self, d):
                return {"allocated_bytes.all.current": (1024 + d) * MB, "reserved_bytes.all.current": (2048 + d) * MB}
            def mem_get_info(self, d): return (10_000 * MB, 16_000 * MB)
        torch = types.SimpleNamespace(cuda=Cuda(), version=types.SimpleNamespace(hip=None))
        rt = stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=0.1)
        rt.devices.collectors.append(CollectorHealth(CudaCollector(torch)))
        time.sleep(0.2)
        stepwatch.progress(1, loss=1.0)
        time.sleep(0.3)
        stepwatch.shutdown()
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 0, proc.stderr
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    with_gpu = [b for b in beats if "gpu_mem_alloc" in b]
    assert {b["msg"] for b in with_gpu} >= {"heartbeat", "progress", "stop"}
    for b in with_gpu:
        assert (b["gpu_mem_alloc"], b["gpu_mem_reserved"]) == (1024, 2048)  # device 0, in MB
        assert isinstance(b["gpu_mem_alloc"], int)
    assert not math.isnan(with_gpu[-1]["ts"])


# torch as a rank of a multi-GPU node sees it: the current device is per thread (set_device on
# the training thread leaves the sampler thread on device 0), and asking the driver about a
# device (mem_get_info) creates a CUDA context there.
PER_THREAD_CUDA = """
import importlib.machinery, sys, threading, time, types
MB = 1 << 20
class Cuda:
    def __init__(self):
        self.local, self.initialized, self.driver_asked = threading.local(), False, set()
        self.reserved = {0: 0, 1: 0, 2: 0}
    def is_available(self): return True
    def is_initialized(self): return self.initialized
    def device_count(self): return 3
    def set_device(self, d): self.local.device, self.initialized = d, True
    def current_device(self): return getattr(self.local, "device", 0)
    def memory_stats(self, d):
        return {"allocated_bytes.all.current": self.reserved[d] // 2, "reserved_bytes.all.current": self.reserved[d]}
    def mem_get_info(self, d):
        self.driver_asked.add(d)
        return (10_000 * MB, 16_000 * MB)
torch = types.ModuleType("torch")
torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
torch.cuda = Cuda()
torch.version = types.SimpleNamespace(hip=None, cuda="12.4")
torch.optim = types.SimpleNamespace()
torch.utils = types.SimpleNamespace(data=types.SimpleNamespace())
sys.modules["torch"] = torch
import stepwatch
"""


@pytest.mark.real
@pytest.mark.parametrize("order", ["set_device_then_init", "init_then_set_device_then_progress", "never_told"])
def test_gpu_memory_fields_come_from_the_ranks_own_device(tmp_path: Path, order: str) -> None:
    """Rank 1 of a node works on device 1. Its heartbeat reports device 1's memory whether the
    runtime saw that device on the training thread (at init, at progress) or never did, and
    the sampler never asks the driver about device 0 (no CUDA context there)."""
    run = tmp_path / "run"
    script = PER_THREAD_CUDA + """
order = sys.argv[2]
if order == "set_device_then_init":
    torch.cuda.set_device(1)
rt = stepwatch.init(out=sys.argv[1], interval=0.05, heartbeat_interval=0.1, auto_instrument=False)
if order != "set_device_then_init":
    torch.cuda.set_device(1)
torch.cuda.reserved[1] = 4096 * MB  # the model, on device 1
torch.cuda.reserved[2] = 64 * MB  # a small buffer the program put on device 2
if order == "init_then_set_device_then_progress":
    stepwatch.progress(1, loss=1.0)
time.sleep(0.6)
stepwatch.shutdown()
print("DRIVER_ASKED", sorted(torch.cuda.driver_asked))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(run), order], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[stepwatch]" not in proc.stderr
    beats = read_heartbeat(run / "heartbeat_rank0.jsonl")
    with_gpu = [b for b in beats if "gpu_mem_alloc" in b]
    assert {b["msg"] for b in with_gpu} >= {"heartbeat", "stop"}
    assert (with_gpu[-1]["gpu_mem_alloc"], with_gpu[-1]["gpu_mem_reserved"]) == (2048, 4096)  # device 1, MB
    assert "DRIVER_ASKED [1, 2]" in proc.stdout  # never device 0: no context made there
