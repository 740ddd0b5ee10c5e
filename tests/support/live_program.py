"""A small CPU training program for the live view's tests: a known plan (``stepwatch.epochs`` over a
loader of ``BATCHES`` batches: ``TOTAL`` steps), a numbered line of its own output every 10 steps,
and whether its stdout is a terminal. ``SLEEP`` between steps keeps it running long enough to be
watched while it trains."""

from __future__ import annotations

EPOCHS = 3
BATCHES = 40
TOTAL = EPOCHS * BATCHES
LINE_EVERY = 10

PROGRAM = f'''
import os, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import stepwatch

torch.manual_seed(0)
torch.set_num_threads(1)
print(f"program stdout is a tty: {{sys.stdout.isatty()}}", flush=True)
if sys.stdout.isatty():  # as a program colours its output on a terminal only
    print("\\x1b[31mprogram in red\\x1b[0m", flush=True)
x = torch.randn({BATCHES} * 8, 4)
loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sleep = float(os.environ.get("LIVE_SLEEP", "0.03"))
done = 0
for epoch in stepwatch.epochs({EPOCHS}):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(sleep)
        done += 1
        if done % {LINE_EVERY} == 0:
            print(f"program line {{done}}: loss {{loss.item():.4f}}", flush=True)
if sys.stdout.isatty():  # the terminal's width now (the test resizes it mid-run)
    print(f"program columns at the end: {{os.get_terminal_size().columns}}", flush=True)
'''
