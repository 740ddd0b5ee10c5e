"""N fast steps of a tiny model started on the line after ``import torch``, with no stepwatch
call in the loop: ``steps_after_import.py N [RUN_DIR]``. With RUN_DIR the program starts capture
itself (``stepwatch.init`` before ``import torch``); without, ``stepwatch run`` started it.

The sampler is kept from ticking until the loop is done (its tick lock held, where the runtime
has one): this stands for a machine where ``import torch`` and the loop finish inside one
sampler period, where patches installed at a tick caught none of the steps."""

import sys

import stepwatch
from stepwatch.capture.api import current_runtime

steps = int(sys.argv[1])
if len(sys.argv) > 2:
    stepwatch.init(out=sys.argv[2])
hold = getattr(getattr(current_runtime(), "sampler", None), "lock", None)  # the sampler cannot tick
if hold is not None:
    hold.acquire()

import torch  # noqa: E402

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _ in range(steps):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

if hold is not None:
    hold.release()
if len(sys.argv) > 2:
    stepwatch.shutdown()
