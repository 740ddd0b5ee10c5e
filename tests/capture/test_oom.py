"""OOM flight recorder: an out-of-memory error passing through ``oom_guard`` or reaching
``sys.excepthook`` becomes an ``error`` event and an ``oom_dump_*`` bundle (spec: "Diagnose and OOM
manifests"; telemetry-current-practice.md "Exports and bundles"), and still propagates unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

import stepwatch
from stepwatch.capture.runtime import is_oom
from stepwatch.guard import reset_swallowed, swallowed
from stepwatch.schema import validate_telemetry_record
from stepwatch.telemetry import load_telemetry_sessions

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

BUNDLE_FILES = {"metadata.json", "environment.json", "events.json", "allocator_summary.json"}


def run_py(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` as a script file, so tracebacks show its source lines."""
    script = cwd / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def only_bundle(run: Path) -> Path:
    bundles = sorted((run / "bundles").glob("oom_dump_*"))
    assert len(bundles) == 1, bundles
    return bundles[0]


def check_bundle(bundle: Path, run: Path, *, reason: str, backend: str) -> dict[str, Any]:
    session_id = json.loads((run / "run.json").read_text())["session_id"]
    assert bundle.name.startswith("oom_dump_") and f"_{backend}_" in bundle.name
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["schema_version"] == 2
    assert manifest["reason"] == reason
    assert manifest["backend"] == backend
    assert manifest["session_id"] == session_id
    assert manifest["session_status"] == "running"  # the bundle is written while the capture runs
    assert manifest["session"]["session_id"] == session_id
    assert manifest["session"]["status"] == "running"
    assert set(manifest["files"]) >= BUNDLE_FILES
    for name in manifest["files"]:
        assert (bundle / name).is_file(), name
    events = json.loads((bundle / "events.json").read_text())
    assert manifest["event_count"] == len(events) >= 2
    for record in events:
        validate_telemetry_record(record)
        assert record["session_id"] == session_id
    assert events[-1]["event_type"] == "error" and events[-1]["metadata"]["oom_reason"] == reason
    assert any(r["event_type"] == "sample" for r in events)  # the ring of what came before
    metadata = json.loads((bundle / "metadata.json").read_text())
    assert metadata["exception"] == reason and metadata["rank"] == 0
    environment = json.loads((bundle / "environment.json").read_text())
    assert environment["pid"] > 0 and environment["devices"][0]["kind"] == "cpu"
    allocator = json.loads((bundle / "allocator_summary.json").read_text())
    assert allocator["backend"] == backend
    return manifest


def error_events(run: Path) -> list[Any]:
    (session,) = load_telemetry_sessions(run)
    assert session.summary.status == "completed"
    return [e for e in session.events if e.event_type == "error"]


def test_memory_error_through_oom_guard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        with stepwatch.phase("train"):
            with stepwatch.oom_guard():
                raise MemoryError("boom")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("MemoryError: boom")
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'raise MemoryError("boom")' in proc.stderr
    assert "[stepwatch]" not in proc.stderr
    (error,) = error_events(run)  # recorded once, though it also reached sys.excepthook
    assert error.metadata["oom_reason"] == "MemoryError: boom"
    assert error.metadata["exception_type"] == "builtins.MemoryError"
    assert error.metadata["phase_path"] == ["train"]
    manifest = check_bundle(only_bundle(run), run, reason="MemoryError: boom", backend="cpu")
    assert manifest["kind"] == "oom_flight_recorder"


def test_uncaught_torch_oom_reaches_the_excepthook(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, time, torch, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        time.sleep(0.1)

        class ShardOOM(torch.OutOfMemoryError):  # a library's own subclass is an OOM too
            pass

        try:
            with stepwatch.oom_guard():
                raise ShardOOM("shard 3 out of memory")
        except ShardOOM:
            print("CAUGHT", flush=True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 1
    assert proc.stdout.strip() == "CAUGHT"
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'raise torch.OutOfMemoryError("CUDA out of memory.' in proc.stderr
    assert "[stepwatch]" not in proc.stderr
    errors = error_events(run)
    reasons = ["ShardOOM: shard 3 out of memory", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert [e.metadata["oom_reason"] for e in errors] == reasons
    assert [e.metadata["exception_type"] for e in errors] == ["__main__.ShardOOM", "torch.OutOfMemoryError"]
    bundles = sorted((run / "bundles").glob("oom_dump_*"))
    assert len(bundles) == 2
    for bundle, reason in zip(bundles, reasons):
        check_bundle(bundle, run, reason=reason, backend="cuda")
        environment = json.loads((bundle / "environment.json").read_text())
        assert isinstance(environment["torch"], str) and environment["cuda_available"] is False


def test_a_non_oom_exception_makes_no_bundle(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import sys, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        with stepwatch.oom_guard():
            raise ValueError("not memory")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("ValueError: not memory")
    assert not list(run.glob("bundles/*"))
    # the uncaught exception is the run's failure (docs/run-outcome.md), not an OOM: no oom_reason
    (error,) = error_events(run)
    assert "oom_reason" not in error.metadata and error.metadata["failure"]["type"] == "ValueError"


def test_oom_guard_passes_the_same_exception_object_on(tmp_path: Path) -> None:
    reset_swallowed()
    rt = stepwatch.init(out=tmp_path / "run", interval=0.05, auto_instrument=False, handle_signals=False,
                        capture_oom=False)
    try:
        error = MemoryError("in-process")

        def allocate() -> None:
            with stepwatch.oom_guard():
                raise error

        with pytest.raises(MemoryError) as caught:
            allocate()
        assert caught.value is error
        assert traceback.extract_tb(error.__traceback__)[-1].name == "allocate"
        with pytest.raises(MemoryError):  # seen again: not recorded twice
            with stepwatch.oom_guard():
                raise error
        with stepwatch.oom_guard():  # nothing raised: nothing recorded
            pass
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
    check_bundle(only_bundle(rt.run_dir), rt.run_dir, reason="MemoryError: in-process", backend="cpu")
    assert len(error_events(rt.run_dir)) == 1


def test_oom_guard_without_a_runtime_is_harmless() -> None:
    assert not stepwatch.current_runtime().active
    with pytest.raises(MemoryError):
        with stepwatch.oom_guard():
            raise MemoryError("nobody listening")


def test_is_oom() -> None:
    class OutOfMemoryError(RuntimeError):  # the name torch uses on every backend
        pass

    class SubclassedOOM(OutOfMemoryError):
        pass

    assert is_oom(MemoryError())
    assert is_oom(OutOfMemoryError("CUDA out of memory"))
    assert is_oom(SubclassedOOM("CUDA out of memory"))
    assert not is_oom(RuntimeError("out of memory"))
    assert not is_oom(ValueError())


@pytest.mark.parametrize(
    ("message", "backend"),
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB", "cuda"),
        ("HIP out of memory. Tried to allocate 2.00 GiB", "rocm"),
        ("MPS backend out of memory (MPS allocated: 8.00 GB)", "mps"),
        ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes", "cpu"),
    ],
    ids=lambda v: v if v in ("cuda", "rocm", "mps", "cpu") else None,
)
@pytest.mark.usefixtures("training_test")
def test_torch_oom_error_record_names_its_bundle_and_the_real_backend(
    tmp_path: Path, message: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    run = tmp_path / "run"
    stepwatch.init(out=run, interval=0.05, handle_signals=False)
    time.sleep(0.1)
    with pytest.raises(torch.OutOfMemoryError, match=message.split(" ")[0]), stepwatch.oom_guard():
        raise torch.OutOfMemoryError(message)
    bundle = only_bundle(run)
    check_bundle(bundle, run, reason=f"OutOfMemoryError: {message}", backend=backend)
    stepwatch.shutdown()
    assert "[stepwatch]" not in capsys.readouterr().err
    (error,) = error_events(run)
    assert error.metadata["oom_dump_path"] == str(bundle.resolve())  # as Stormlog's error records do
    recorded = json.loads((bundle / "events.json").read_text())[-1]
    assert recorded["metadata"]["oom_dump_path"] == str(bundle.resolve())  # the bundle holds that record


def test_an_oom_whose_bundle_cannot_be_written_is_still_recorded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_py(
        """
        import pathlib, sys, stepwatch
        stepwatch.init(out=sys.argv[1], interval=0.05)
        (pathlib.Path(sys.argv[1]) / "bundles").write_text("a file where the bundle directory goes")
        with stepwatch.oom_guard():
            raise MemoryError("boom")
        """,
        tmp_path, str(run),
    )
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("MemoryError: boom")
    assert proc.stderr.count("[stepwatch]") == 1 and "oom.bundle" in proc.stderr
    (error,) = error_events(run)
    assert error.metadata["oom_reason"] == "MemoryError: boom"
    assert "oom_dump_path" not in error.metadata and error.metadata["oom_dump_error"]
