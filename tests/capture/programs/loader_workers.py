"""One process training over a DataLoader with 2 worker processes (start method from argv):
the workers load batches and must stay out of the capture. 3 epochs of 8 batches: 24 steps."""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1],
                        persistent_workers=False)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
