"""The smallest run ``run --export`` needs: one rank, six steps with a loss mark each, then
exit code 3 (the export happens all the same, and the code stays the training's)."""

from __future__ import annotations

import sys

import torch
from torch import nn

import stepwatch

torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _ in range(6):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    stepwatch.mark("loss", loss.item())
sys.exit(3)
