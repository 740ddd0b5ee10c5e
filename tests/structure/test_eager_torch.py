"""The suite's ``eager_torch`` sitecustomize (tests/support/eager_torch) saves torch's compiler
import in the processes the suite starts and changes nothing they compute: the same training
with and without it ends with the same bytes in every parameter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import EAGER_TORCH, clean_env

PROGRAM = textwrap.dedent("""
    import hashlib, json, sys
    import torch

    torch.manual_seed(0)
    digests = {}
    for name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
                       ("adam", lambda p: torch.optim.Adam(p, lr=1e-2)),
                       ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = make(model.parameters())
        for _ in range(25):
            optimizer.zero_grad()
            loss = model(torch.randn(32, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
        assert torch.is_grad_enabled()
        digest = hashlib.sha256()
        for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor))]:
            digest.update(tensor.detach().numpy().tobytes())
        digests[name] = digest.hexdigest()
    print(json.dumps({"digests": digests, "compiler_imported": "torch._dynamo" in sys.modules}))
""")


def _train(with_eager_torch: bool) -> dict[str, object]:
    env = clean_env()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != EAGER_TORCH]
    env["PYTHONPATH"] = os.pathsep.join([EAGER_TORCH, *paths] if with_eager_torch else paths)
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


@pytest.mark.real
def test_the_suites_processes_train_alike_with_no_compiler_imported() -> None:
    eager, plain = _train(True), _train(False)
    assert eager["digests"] == plain["digests"]
    assert eager["compiler_imported"] is False  # the 1.3 s it saves
    assert plain["compiler_imported"] is True  # torch's own behaviour, which it stands in for


def test_the_folder_is_on_the_path_every_started_process_gets() -> None:
    assert EAGER_TORCH in os.environ["PYTHONPATH"].split(os.pathsep)
    assert (Path(EAGER_TORCH) / "sitecustomize.py").is_file()
