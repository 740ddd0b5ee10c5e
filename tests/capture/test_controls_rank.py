"""The rank's side of the controls, in a real capture (this process, or a small program):
the phase its heartbeat records name, the halt at the step boundary, a halt read too late or for
another session, a memory snapshot asked of a CPU-only rank, a program's own handler on the
stack dump signal left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

import stepwatch
from stepwatch.artifacts.halt import HALT_FILENAME, HaltRequest
from stepwatch.artifacts.heartbeat import read_heartbeat
from stepwatch.artifacts.memory_snapshots import read_memory_snapshot_answers, request_memory_snapshot
from stepwatch.capture import api
from stepwatch.guard import reset_swallowed, swallowed

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

torch = pytest.importorskip("torch")


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A running capture that ticks every 0.1 s and writes a heartbeat every 0.1 s."""
    assert not api.current_runtime().active
    reset_swallowed()
    out = tmp_path / "run"
    stepwatch.init(out=out, interval=0.1, heartbeat_interval=0.1, handle_signals=False, capture_oom=False)
    try:
        yield out
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}


def _until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _heartbeats(run: Path) -> list[dict[str, object]]:
    api.current_runtime().heartbeat.flush()  # type: ignore[union-attr]
    return [r for r in read_heartbeat(run / "heartbeat_rank0.jsonl") if r["msg"] == "heartbeat"]


class _Sleepy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.sleep_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.lin(x)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_heartbeat_records_name_the_phase_the_training_thread_is_in(run_dir: Path) -> None:
    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stepwatch.trace_step(model):
        _step(model, opt)
    model.sleep_s = 0.8
    with stepwatch.trace_step(model):
        _step(model, opt)  # 0.8 s inside forward
    model.sleep_s = 0.0
    time.sleep(0.8)  # between steps
    with stepwatch.trace_step(model):
        time.sleep(0.8)  # in a step, no phase open
    time.sleep(0.3)
    records = _heartbeats(run_dir)
    in_forward = [r for r in records if r.get("phase") == "forward"]
    assert in_forward and max(r["phase_s"] for r in in_forward) >= 0.5  # type: ignore[type-var]
    assert any(r.get("phase") == "step" and r["phase_s"] >= 0.5 for r in records)  # type: ignore[operator]
    between = [r for r in records if r.get("phase", "absent") is None]
    assert len(between) >= 3 and all("phase_s" not in r for r in between)


def test_halt_requested_turns_true_when_the_target_step_completes_and_the_next_step_raises(run_dir: Path) -> None:
    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with stepwatch.trace_step(model):
            _step(model, opt)
    stepwatch.request_halt(run_dir, at_step=5, reason="unit")
    runtime = api.current_runtime()
    _until(lambda: runtime.halt is not None)  # type: ignore[union-attr]
    with stepwatch.trace_step(model):
        _step(model, opt)
    assert not stepwatch.halt_requested()  # step 4 done, the target is 5
    with stepwatch.trace_step(model):
        _step(model, opt)
    assert stepwatch.halt_requested()  # step 5 done: the loop may save and stop here
    training = runtime.training  # type: ignore[union-attr]
    # the one way a halt stops the loop: the training state's trap; none of its methods replaced
    assert training.trap is not None and not {"phase_begin", "open_step"} & set(vars(training))
    assert training.on_step == runtime._on_step  # type: ignore[union-attr]  # the step callback stays the same
    with pytest.raises(stepwatch.Halt) as raised, stepwatch.trace_step(model):
        _step(model, opt)
    assert training.trap is None  # raised once, then gone
    assert raised.value.code == 0 and raised.value.step == 5 and "unit" in str(raised.value)
    assert isinstance(raised.value, SystemExit)
    assert runtime.step == 5 and runtime.outcome() == "halted"  # type: ignore[union-attr]
    end = json.loads((run_dir / "outcome_rank0.json").read_text())
    assert end["outcome"] == "halted" and end["halt"]["step"] == 5 and end["halt"]["late"] is False
    with stepwatch.trace_step(model):  # a program that catches Halt goes on: raised once
        _step(model, opt)


def test_an_inferred_loop_halts_at_the_first_phase_after_the_target_step(run_dir: Path) -> None:
    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    stepwatch.request_halt(run_dir, at_step=3, reason="inferred")
    _until(lambda: api.current_runtime().halt is not None)  # type: ignore[union-attr]
    _step(model, opt)
    _step(model, opt)
    assert stepwatch.halt_requested()
    with pytest.raises(stepwatch.Halt):
        model(torch.randn(2, 4))  # the forward of step 4 never runs
    assert api.current_runtime().step == 3  # type: ignore[union-attr]


def test_a_halt_read_after_its_step_stops_at_the_next_boundary_and_says_late(run_dir: Path) -> None:
    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        _step(model, opt)
    request = HaltRequest(target_step=2, reason="late", requested_at=time.time(), iso="x", by="test")
    (run_dir / HALT_FILENAME).write_bytes(msgspec.json.encode(request))  # past the CLI's refusal
    _until(stepwatch.halt_requested)
    with pytest.raises(stepwatch.Halt):
        _step(model, opt)
    record = api.current_runtime().halt_record()  # type: ignore[union-attr]
    assert record is not None and record["step"] == 4 and record["target_step"] == 2 and record["late"] is True


def test_a_halt_for_another_session_is_ignored(run_dir: Path) -> None:
    request = HaltRequest(target_step=1, reason="not ours", requested_at=time.time(), iso="x", by="test",
                          session_id="another-session")
    (run_dir / HALT_FILENAME).write_bytes(msgspec.json.encode(request))
    time.sleep(0.5)
    assert api.current_runtime().halt is None and not stepwatch.halt_requested()  # type: ignore[union-attr]


def test_a_cpu_rank_answers_a_memory_snapshot_request_with_a_note_and_no_file(run_dir: Path) -> None:
    request = request_memory_snapshot(run_dir, reason="HIGH_PRESSURE on rank 0")
    _until(lambda: read_memory_snapshot_answers(run_dir, request.request_id))
    (answer,) = read_memory_snapshot_answers(run_dir, request.request_id)
    assert answer["status"] == "no_cuda" and answer["rank"] == 0 and "does not use CUDA" in answer["note"]
    assert not list((run_dir / "memory_snapshots").glob("*.pickle"))
    time.sleep(0.4)  # the same request is answered once
    assert len(read_memory_snapshot_answers(run_dir, request.request_id)) == 1
    api.current_runtime().heartbeat.flush()  # type: ignore[union-attr]
    noted = [r for r in read_heartbeat(run_dir / "heartbeat_rank0.jsonl") if r["msg"] == "memory_snapshot"]
    assert [r["status"] for r in noted] == ["no_cuda"]


OWN_HANDLER = textwrap.dedent('''
    import os, signal, sys, time
    got = []
    signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
    import stepwatch
    stepwatch.init(out=sys.argv[1])
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.2)
    print("handler kept" if got and callable(signal.getsignal(signal.SIGUSR2)) else "handler lost")
''')


def test_a_program_with_its_own_handler_on_the_signal_keeps_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run([sys.executable, "-c", OWN_HANDLER, str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "handler kept"
    assert "has its own handler for SIGUSR2" in result.stderr and result.stderr.count("own handler") == 1
    boot = read_heartbeat(tmp_path / "run" / "heartbeat_rank0.jsonl")[0]
    assert boot["msg"] == "boot" and "stack_signal" not in boot


def test_the_stack_signal_is_configurable_by_env(tmp_path: Path) -> None:
    script = "import sys, stepwatch; stepwatch.init(out=sys.argv[1])"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    for value, expected in (("SIGUSR1", int(signal.SIGUSR1)), ("off", None)):
        out = tmp_path / value
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=60,
                       env={**env, "STEPWATCH_STACK_SIGNAL": value})
        boot = read_heartbeat(out / "heartbeat_rank0.jsonl")[0]
        assert boot.get("stack_signal") == expected


def test_removing_halt_before_its_step_cancels_it(run_dir: Path) -> None:
    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    stepwatch.request_halt(run_dir, at_step=3, reason="cancel me")
    runtime = api.current_runtime()
    _until(lambda: runtime.halt is not None)  # type: ignore[union-attr]
    (run_dir / HALT_FILENAME).unlink()
    _until(lambda: runtime.halt is None)  # type: ignore[union-attr]
    for _ in range(4):
        _step(model, opt)
    assert not stepwatch.halt_requested() and runtime.step == 5  # type: ignore[union-attr]


def test_the_halt_is_raised_on_the_training_thread_only(run_dir: Path) -> None:
    import threading

    model = _Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    stepwatch.request_halt(run_dir, at_step=2, reason="threads")
    _until(lambda: api.current_runtime().halt is not None)  # type: ignore[union-attr]
    _step(model, opt)
    assert stepwatch.halt_requested()
    other: list[BaseException] = []

    def infer() -> None:
        try:
            with torch.no_grad():
                model(torch.randn(2, 4))
        except BaseException as exc:  # noqa: BLE001
            other.append(exc)

    thread = threading.Thread(target=infer)
    thread.start()
    thread.join()
    assert other == []  # another thread's forward runs as ever
    with pytest.raises(stepwatch.Halt):
        model(torch.randn(2, 4))


def test_memory_history_on_a_cpu_only_process_is_a_no_op(tmp_path: Path) -> None:
    assert not api.current_runtime().active
    reset_swallowed()
    runtime = stepwatch.init(out=tmp_path / "run", memory_history=True, handle_signals=False, capture_oom=False)
    try:
        assert runtime.memory.wanted and not runtime.memory.history  # type: ignore[union-attr]
    finally:
        stepwatch.shutdown()
    assert swallowed() == {}
