"""The Hogwild example (pytorch/examples mnist_hogwild), tiny: one model in shared memory trained
by 2 mp.Process workers (start method from argv), then tested by the parent (forward only).
Each worker: 2 epochs of 40 samples in batches of 5, 8 steps per epoch, 16 steps."""

import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def train(rank: int, model: torch.nn.Module, data: TensorDataset) -> None:
    torch.manual_seed(rank)
    loader = DataLoader(data, batch_size=5, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()


if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    model = torch.nn.Linear(8, 1)
    model.share_memory()
    processes = [ctx.Process(target=train, args=(rank, model, data)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=20):
            F.mse_loss(model(x), y)
