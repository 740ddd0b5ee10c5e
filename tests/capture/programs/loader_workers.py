"""DataLoader workers stay out of the capture, while a training worker is in: the process trains
2 epochs over a DataLoader with 2 worker processes (their start method from argv; 8 batches an
epoch: 16 steps), then starts one training worker (fork) that trains 1 epoch over a loader of
its own with 2 workers (8 steps)."""

import multiprocessing
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def train(data: TensorDataset, epochs: int) -> None:
    # persistent: the two workers serve both epochs (a spawned worker imports torch: 2 s of CPU each)
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1],
                        persistent_workers=True)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()


if __name__ == "__main__":
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    train(data, 2)
    worker = multiprocessing.get_context("fork").Process(target=train, args=(data, 1))
    worker.start()
    worker.join()
    assert worker.exitcode == 0, worker.exitcode
