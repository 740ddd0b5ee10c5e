"""A training loop with no stepwatch code: ``loss_no_code.py STEPS NAN_FROM`` (NAN_FROM < 0:
never). A DataLoader feeds a tiny regression; the loss turns NaN at step NAN_FROM and stays NaN.
Each step also takes a gradient penalty through ``torch.autograd.grad`` and clips the gradient
norm with ``clip_grad_norm_``."""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

steps, nan_from = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(steps * 8, 4), torch.randn(steps * 8, 1)), batch_size=8)
for step, (x, y) in enumerate(loader):
    x.requires_grad_(True)
    optimizer.zero_grad()
    out = model(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # a gradient penalty: no loss
    loss = torch.nn.functional.mse_loss(out, y) + 0.1 * grad_x.pow(2).mean()
    if 0 <= nan_from <= step:
        loss = loss * float("nan")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
