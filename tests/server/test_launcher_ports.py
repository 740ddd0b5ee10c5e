"""``stepwatch run``'s rendezvous port (server/launcher.py ``master_port``): a single-node job
takes a free port unless the user names one, so two jobs can share a machine; a multi-node job
keeps torchrun's 29500, which every node names alike."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from stepwatch.errors import ConfigError
from stepwatch.server.launcher import TORCHRUN_PORT, LaunchOptions, _training_command, master_port
from tests.support import STEPWATCH, clean_env, free_port
from tests.support.shared import once

pytestmark = pytest.mark.real  # every test here starts a process or trains a model


def options(**given: Any) -> LaunchOptions:
    return LaunchOptions(script=["train.py"], **{"nproc_per_node": 2, **given})


def test_a_named_port_is_kept_and_torchruns_own_variables_are_left_to_it() -> None:
    assert master_port(options(master_port=1234), {"MASTER_PORT": "4321"}) == 1234
    assert master_port(options(), {"MASTER_PORT": " 4321 "}) == 4321
    assert master_port(options(nnodes=2), {"MASTER_PORT": "4321"}) == 4321
    for env in ({"PET_MASTER_PORT": "5555"}, {"PET_RDZV_ENDPOINT": "head:5555"}):
        assert master_port(options(), env) is None
        assert not [a for a in _training_command(options(), None) if a.startswith("--master-port")]
    assert "--master-port=1234" in _training_command(options(), 1234)


@pytest.mark.parametrize("bad", ["http", "0", "70000", "-1"])
def test_a_master_port_variable_that_is_not_a_port_is_one_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        master_port(options(), {"MASTER_PORT": bad})


def test_several_nodes_keep_torchruns_port_and_one_node_takes_a_free_one() -> None:
    assert master_port(options(nnodes=2), {}) == TORCHRUN_PORT == 29500
    with socket.socket() as held:  # a first job's rendezvous, listening
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for _ in range(5):
            port = master_port(options(), {})
            assert port not in (taken, None)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))  # free indeed


JOB = '''
import os, sys, time
control, job, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = int(os.environ["RANK"])
with open(os.path.join(control, f"{job}-rank{rank}"), "w") as out:
    out.write(os.environ["MASTER_PORT"])
deadline = time.time() + 60  # every job's ranks up at once: the jobs overlap
while len(os.listdir(control)) < world and time.time() < deadline:
    time.sleep(0.1)
if job != "named":  # a real data-parallel job: rendezvous, and gradients all-reduced through its MASTER_PORT
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step(); opt.zero_grad()
    dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def three_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three ``stepwatch run --nproc-per-node 2`` jobs on one machine at once: two with no port
    named (the data-parallel ones), one with ``MASTER_PORT`` exported."""
    return once(tmp_path_factory, "launcher-three-jobs", _three_jobs)


def _three_jobs(base: Path) -> dict[str, Any]:
    pytest.importorskip("torch")
    control = base / "control"
    control.mkdir()
    (base / "job.py").write_text(JOB)
    named = free_port()
    jobs: dict[str, subprocess.Popen[str]] = {}
    for job in ("first", "second", "named"):
        env = clean_env()
        if job == "named":
            env["MASTER_PORT"] = str(named)
        jobs[job] = subprocess.Popen([*STEPWATCH, "run", "--nproc-per-node", "2", "--interval", "200", "--quiet",
                                      "--out", str(base / job), "job.py", str(control), job, "6"],
                                     cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    results = {job: proc.communicate(timeout=300) for job, proc in jobs.items()}
    return {"base": base, "control": control, "named": named, "results": results,
            "codes": {job: proc.returncode for job, proc in jobs.items()}, "seconds": time.monotonic() - started}


def test_two_single_node_jobs_at_once_both_succeed(three_jobs: dict[str, Any]) -> None:
    for job, (_, err) in three_jobs["results"].items():
        assert three_jobs["codes"][job] == 0, f"job {job}:\n{err[-3000:]}"  # a string: shown whole
        assert "EADDRINUSE" not in err and "address already in use" not in err.lower()
    ports = {job: {(three_jobs["control"] / f"{job}-rank{r}").read_text() for r in (0, 1)}
             for job in ("first", "second", "named")}
    assert all(len(seen) == 1 for seen in ports.values()), ports  # one rendezvous per job
    first, second = ports["first"].pop(), ports["second"].pop()
    assert first != second and str(TORCHRUN_PORT) not in (first, second)
    for job, port in (("first", first), ("second", second)):
        manifest = json.loads((three_jobs["base"] / job / "run.json").read_text())
        assert manifest["extra"]["master_port"] == int(port) and manifest["outcome"] == "succeeded"


def test_a_port_the_user_names_is_the_one_the_ranks_get(three_jobs: dict[str, Any]) -> None:
    assert three_jobs["codes"]["named"] == 0
    assert {(three_jobs["control"] / f"named-rank{r}").read_text() for r in (0, 1)} == {str(three_jobs["named"])}
    assert json.loads((three_jobs["base"] / "named" / "run.json").read_text())["extra"]["master_port"] \
        == three_jobs["named"]


def test_one_process_and_one_torchrun_rank_still_run(tmp_path: Path) -> None:
    (tmp_path / "one.py").write_text("import os\nprint('port', os.environ.get('MASTER_PORT'), 'rank', "
                                     "os.environ.get('RANK', os.environ.get('STEPWATCH_RANK')))\n")
    for extra in ([], ["--nproc-per-node", "1", "--torchrun"]):
        proc = subprocess.run([*STEPWATCH, "run", "--quiet", "--out", str(tmp_path / f"run{len(extra)}"), *extra,
                               "one.py"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("port"))
        if extra:
            assert line != "port None rank 0" and line.endswith("rank 0") and "29500" not in line
        else:
            assert line == "port None rank 0"
    assert os.path.isfile(tmp_path / "run0" / "final_summary.json")
