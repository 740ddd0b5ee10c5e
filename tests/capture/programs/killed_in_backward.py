"""A plain training loop (no stepwatch code but ``init``) whose sixth backward hangs, as a rank's
backward waits in an all-reduce for a rank that hangs: the test kills it there with SIGTERM.

argv: run directory, the file written once the hanging backward has begun."""

import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import stepwatch

run_dir, flag = sys.argv[1], Path(sys.argv[2])
stepwatch.init(out=run_dir)
torch.set_num_threads(1)
HANG_AT = 5
calls = {"backward": 0}


class Waits(torch.autograd.Function):
    """The identity, whose backward waits (in Python, so SIGTERM's handler runs) at HANG_AT."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        calls["backward"] += 1
        if calls["backward"] == HANG_AT + 1:
            flag.write_text("in backward")
            time.sleep(120)
        return grad


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(80, 4), torch.randn(80, 1)), batch_size=8)
for x, y in loader:
    loss = torch.nn.functional.mse_loss(Waits.apply(model(x)), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
