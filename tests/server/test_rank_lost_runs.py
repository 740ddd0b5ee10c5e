"""A rank lost on another host is named RANK_LOST, not STALL (docs/watchdog.md): two real ranks
(tiny torch loops under ``stepwatch.init``) ship to a real ``stepwatch serve`` over TCP, and name
other hosts in their records (``socket.gethostname`` is what the runtime takes its host from), so
no pid of theirs can be checked here. Rank 1 first holds the GIL for 3 s (no heartbeat, no
frame, its connection open); then rank 0 is SIGKILLed; then rank 1 ends cleanly."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch.schema import new_session_id
from tests.support import STEPWATCH, clean_env
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model

pytest.importorskip("torch")

STALL_AFTER_S = 8.0

RANK = '''
import ctypes, os, socket, sys, time
rank, host, out, control = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if host != "-":
    socket.gethostname = lambda: host  # this rank's records name another host
import torch
import stepwatch

stepwatch.init(out=out, interval=0.2, heartbeat_interval=0.5, rank=rank, local_rank=0, world_size=2)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
frozen = False
for step in range(1, 100_000):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    if step == 20:
        open(os.path.join(control, f"at20-{rank}"), "w").close()
    if not frozen and os.path.exists(os.path.join(control, f"freeze-{rank}")):
        frozen = True
        ctypes.PyDLL(None).sleep(3)  # in C with the GIL held: the sampler thread is silent too
        open(os.path.join(control, f"thawed-{rank}"), "w").close()
    if os.path.exists(os.path.join(control, "finish")):
        break
    time.sleep(0.03)
'''


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _alerts(hub: Path) -> list[dict[str, Any]]:
    path = hub / "alerts.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return once(tmp_path_factory, "rank-lost-on-another-host", _lost_run)


def _lost_run(base: Path) -> dict[str, Any]:
    hub, control = base / "hub", base / "control"
    control.mkdir()
    (base / "rank.py").write_text(RANK)
    env = clean_env()
    server = subprocess.Popen([*STEPWATCH, "serve", "--out", str(hub), "--port", "0",
                               "--stall-after", str(STALL_AFTER_S)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ranks: dict[int, subprocess.Popen[bytes]] = {}
    try:
        assert server.stdout is not None
        ready = json.loads(server.stdout.readline())
        env.update(STEPWATCH_AGGREGATOR=ready["tcp"], STEPWATCH_SESSION_ID=new_session_id())
        where = {0: ("node-b", base / "node-b"), 1: ("node-c", base / "node-c")}
        for rank, (host, out) in where.items():
            with (base / f"rank{rank}.log").open("w") as log:
                ranks[rank] = subprocess.Popen([sys.executable, str(base / "rank.py"), str(rank), host, str(out),
                                                str(control)], env=env, stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: all((control / f"at20-{r}").exists() for r in ranks), 120, "every rank at step 20")
        (control / "freeze-1").touch()  # silent longer than its heartbeat's grace, shorter than a stall
        _wait(lambda: (control / "thawed-1").exists(), 30, "rank 1 to thaw")
        time.sleep(1.5)  # the watchdog hears rank 1 again and ticks after it
        ranks[0].send_signal(signal.SIGKILL)
        killed_at = time.time()
        # the loss is judged within the grace (2.5 heartbeat intervals); STALL_AFTER_S later,
        # without it, the watchdog would call rank 0 stalled
        _wait(lambda: any(a["kind"] == "RANK_LOST" for a in _alerts(hub)), STALL_AFTER_S + 10, "RANK_LOST")
        lost_seen_after_s = time.time() - killed_at
        (control / "finish").touch()
        codes = {rank: proc.wait(60) for rank, proc in ranks.items()}
        outputs = {rank: (base / f"rank{rank}.log").read_text() for rank in ranks}
    finally:
        for proc in ranks.values():
            if proc.poll() is None:
                proc.kill()
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
    with sqlite3.connect(hub / "history.sqlite") as db:
        stored = db.execute("SELECT kind, ranks, evidence FROM alerts").fetchall()
    return {"hub": hub, "base": base, "codes": codes, "outputs": outputs, "alerts": _alerts(hub),
            "stored": stored, "server_out": out, "server_err": err, "lost_seen_after_s": lost_seen_after_s}


def test_a_rank_killed_on_another_host_is_rank_lost_naming_it_and_how_it_is_known(lost_run: dict[str, Any]) -> None:
    assert lost_run["codes"] == {0: -signal.SIGKILL, 1: 0}, lost_run["outputs"]
    [alert] = lost_run["alerts"]  # not a STALL of rank 0, and nothing on rank 1
    assert alert["kind"] == "RANK_LOST" and alert["ranks"] == [0], alert
    evidence = alert["evidence"]
    assert evidence["lost_by"] == "connection" and evidence["host"] == "node-b"
    assert evidence["connection_dropped_at"] and evidence["last_heartbeat"] and isinstance(evidence["pid"], int)
    assert isinstance(evidence["last_step"], int)  # the last its frames carried
    assert "on node-b" in alert["message"] and "connection to the aggregator closed at" in alert["message"]
    assert lost_run["lost_seen_after_s"] < STALL_AFTER_S  # said before a stall could have been
    assert [(kind, json.loads(ranks)) for kind, ranks, _ in lost_run["stored"]] == [("RANK_LOST", [0])]
    stopped = json.loads(lost_run["server_out"].strip().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["stats"]["dropped_without_stop"] == 1


def test_a_rank_of_another_host_silent_in_c_for_3_s_then_ending_is_neither_lost_nor_stalled(lost_run: dict[str, Any]) -> None:
    beats = [json.loads(line)["ts"] for line in (lost_run["base"] / "node-c" / "heartbeat_rank1.jsonl")
             .read_text().splitlines() if line.strip()]
    assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) >= 2.5  # it did go silent
    assert [a for a in lost_run["alerts"] if a["ranks"] != [0]] == []
