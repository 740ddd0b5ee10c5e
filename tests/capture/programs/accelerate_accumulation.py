"""A Hugging Face Accelerate loop with gradient accumulation and no stepwatch code but ``init``:
96 batches over 2 epochs with ``gradient_accumulation_steps=4``, so 24 optimizer updates.
Accelerate's ``DataLoaderShard`` iterates a ``DataLoader`` inside its own, one batch ahead.

argv: the run directory."""

import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import stepwatch

stepwatch.init(out=sys.argv[1], handle_signals=False)
torch.set_num_threads(1)
torch.manual_seed(0)
accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
loader = DataLoader(TensorDataset(torch.randn(384, 8), torch.randn(384, 1)), batch_size=8)  # 48 a pass
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
updates = 0
for _epoch in range(2):
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            updates += accelerator.sync_gradients
            optimizer.zero_grad()
print("UPDATES", updates)
