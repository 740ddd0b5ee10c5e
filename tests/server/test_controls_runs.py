"""Acting on a running job, for real: ``stepwatch halt`` stops two gloo DDP ranks under
``stepwatch run`` at the same step; a loop that asks ``halt_requested()`` saves and stops itself;
``stepwatch dump-stacks`` gets the stacks of a rank asleep in a named function and of a rank
stuck in C code that holds the GIL (docs/halt.md, docs/stacks.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from stepwatch.artifacts.heartbeat import read_heartbeat
from stepwatch.artifacts.step_ledger import find_ledgers, read_ledger
from tests.support import STEPWATCH, clean_env, free_port

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

DDP_TRAIN = '''
import sys, time
import torch
import torch.distributed as dist
import stepwatch

dist.init_process_group("gloo")
rank = dist.get_rank()
stall_step, stall_s, checkpoint = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]


class Slow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if rank == 1 and self.calls == stall_step:
            time.sleep(stall_s)  # rank 1 slow in forward: rank 0 waits in backward's all-reduce
        return self.lin(x)


model = torch.nn.parallel.DistributedDataParallel(Slow())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
done = 0
while True:
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if checkpoint != "-" and stepwatch.halt_requested():
            with open(f"{checkpoint}.rank{rank}", "w") as f:
                f.write(str(done))  # "saves a checkpoint", then stops
            sys.exit(0)
        time.sleep(0.01)
'''

STUCK = '''
import os, time

def sleeping_in_a_named_function():
    time.sleep(600)

def spinning_in_c_with_the_gil():
    return sum(range(1 << 62))  # one C call: holds the GIL, never checks signals

if int(os.environ["RANK"]) == 0:
    sleeping_in_a_named_function()
else:
    spinning_in_c_with_the_gil()
'''


def _start(base: Path, out: Path, script: str, *args: str, nproc: int = 2) -> subprocess.Popen[str]:
    (base / "train.py").write_text(script)
    command = [*STEPWATCH, "run", "--interval", "200", "--out", str(out)]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    return subprocess.Popen([*command, "train.py", *args], cwd=base, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(condition, timeout: float, what: str, proc: subprocess.Popen[str]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _ledger_steps(out: Path) -> dict[int, int]:
    """Per rank, the steps its step ledger recorded (the last step's number)."""
    steps: dict[int, int] = {}
    for path in find_ledgers(out):
        ledger = read_ledger(path)
        if ledger.records:
            steps[ledger.rank] = ledger.records[-1].index + 1
    return steps


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STEPWATCH, *args], env=clean_env(), capture_output=True, text=True, timeout=60)


def _end(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the job did not end: {output}") from None
    return output


def test_halt_stops_two_ddp_ranks_at_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(tmp_path, out, DDP_TRAIN, "5", "8", "-")  # 8 s: a heartbeat (every 5-6 s) falls inside
    try:
        _wait_for(lambda: len(_ledger_steps(out)) == 2 and min(_ledger_steps(out).values()) >= 20, 120,
                  "both ranks to step", proc)
        halted = _cli("halt", str(out), "--reason", "make room for another job")
        assert halted.returncode == 0, halted.stderr
        request = json.loads((out / ".HALT").read_text())
        target = request["target_step"]
        assert f"halt requested at step {target}" in halted.stdout
        output = _end(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output  # Halt is SystemExit(0)
    # both ranks stopped at the target: their step ledgers, end files and the history agree
    assert _ledger_steps(out) == {0: target, 1: target}
    for rank in (0, 1):
        end = json.loads((out / f"outcome_rank{rank}.json").read_text())
        assert end["outcome"] == "halted" and end["halt"]["step"] == target and not end["halt"]["late"]
    run = json.loads((out / "run.json").read_text())
    assert run["outcome"] == "halted"
    assert run["error"]["kind"] == "halt" and run["error"]["step"] == target
    assert run["error"]["reason"] == "make room for another job"
    assert run["error"]["steps"] == {"0": target, "1": target}
    summary = json.loads((out / "final_summary.json").read_text())
    assert summary["outcome"] == "halted" and summary["error"]["step"] == target
    assert {rank: r["steps"] for rank, r in summary["per_rank"].items()} == {"0": target, "1": target}
    assert f"halted at step {target} on request: make room for another job" in output
    # the current phase in the heartbeat: while rank 1 sat in its slow forward, rank 0 waited
    # in backward (DDP's all-reduce), and each record says how long it had been there
    phases = {rank: [r for r in read_heartbeat(out / f"heartbeat_rank{rank}.jsonl") if r["msg"] == "heartbeat"]
              for rank in (0, 1)}
    assert all("phase" in r for records in phases.values() for r in records)
    assert any(r["phase"] == "forward" and r["phase_s"] >= 0.5 for r in phases[1])
    assert any(r["phase"] == "backward" and r["phase_s"] >= 0.5 for r in phases[0])


def test_a_loop_that_asks_halt_requested_saves_and_stops_itself(tmp_path: Path) -> None:
    out = tmp_path / "run"
    checkpoint = tmp_path / "ckpt"
    proc = _start(tmp_path, out, DDP_TRAIN, "0", "0", str(checkpoint))
    try:
        _wait_for(lambda: len(_ledger_steps(out)) == 2 and min(_ledger_steps(out).values()) >= 10, 90,
                  "both ranks to step", proc)
        # a step already passed is refused, and nothing is written
        passed = _cli("halt", str(out), "--at-step", "3")
        assert passed.returncode == 2
        assert passed.stderr.startswith("error:") and "already passed" in passed.stderr
        assert not (out / ".HALT").exists()
        target = max(_ledger_steps(out).values()) + 300
        asked = _cli("halt", str(out), "--at-step", str(target), "--reason", "checkpoint and stop")
        assert asked.returncode == 0, asked.stderr
        assert f"halt requested at step {target} (as asked)" in asked.stdout
        output = _end(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert checkpoint.with_name("ckpt.rank0").read_text() == str(target)
    assert checkpoint.with_name("ckpt.rank1").read_text() == str(target)
    run = json.loads((out / "run.json").read_text())
    assert run["outcome"] == "halted" and run["error"]["steps"] == {"0": target, "1": target}


def test_dump_stacks_of_a_sleeping_rank_and_of_a_rank_stuck_in_c_holding_the_gil(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start(tmp_path, out, STUCK)
    pids: list[int] = []
    try:
        def booted() -> bool:
            files = [out / f"heartbeat_rank{r}.jsonl" for r in (0, 1)]
            return all(f.is_file() and f.stat().st_size > 0 for f in files)

        _wait_for(booted, 90, "both ranks to boot", proc)
        pids = [read_heartbeat(out / f"heartbeat_rank{r}.jsonl")[0]["pid"] for r in (0, 1)]
        time.sleep(1.0)  # let rank 1 get into its C call
        dumped = _cli("dump-stacks", str(out))
        assert dumped.returncode == 0, dumped.stderr
        files = [Path(line) for line in dumped.stdout.split()]
        assert sorted(p.name.split("-")[0] for p in files) == ["rank0", "rank1"]
        by_rank = {p.name.split("-")[0]: p.read_text() for p in files}
        assert "in sleeping_in_a_named_function" in by_rank["rank0"]
        assert "in spinning_in_c_with_the_gil" in by_rank["rank1"]
        assert "stepwatch-sampler" not in by_rank["rank0"] or "Thread" in by_rank["rank0"]  # every thread
        assert by_rank["rank0"].count("Thread 0x") + by_rank["rank0"].count("Current thread") >= 2
        # one rank only; a rank that does not exist is bad input
        one = _cli("dump-stacks", str(out), "--rank", "1")
        assert one.returncode == 0 and Path(one.stdout.strip()).name.startswith("rank1-")
        missing = _cli("dump-stacks", str(out), "--rank", "7")
        assert missing.returncode == 2 and missing.stderr.startswith("error:")
    finally:
        for pid in pids:  # rank 1 cannot run a Python SIGTERM handler: end both for good
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
