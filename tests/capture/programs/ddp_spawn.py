"""The DDP tutorial's multigpu.py (pytorch/examples, distributed/ddp-tutorial-series), made CPU
with gloo and tiny: 2 ranks started by torch.multiprocessing.spawn, each given its rank in
init_process_group, no torchrun environment. 3 epochs of 64 samples in batches of 8 over 2 ranks:
4 steps per epoch, 12 per rank."""

import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup(rank: int, world_size: int, port: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


def main(rank: int, world_size: int, port: str, epochs: int) -> None:
    ddp_setup(rank, world_size, port)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = DataLoader(data, batch_size=8, shuffle=False, sampler=DistributedSampler(data))
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for epoch in range(epochs):
        b_sz = len(next(iter(loader))[0])  # as the tutorial does: a peek at the batch size
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
        print(f"[GPU{rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(loader)}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    mp.spawn(main, args=(world_size, sys.argv[1], 3), nprocs=world_size)
