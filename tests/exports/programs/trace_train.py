"""A small data-parallel run (gloo, CPU) with what a trace shows besides the inferred steps: a
user scope inside each step (with attrs), a scope on a second thread, and a loss mark per step.
Two epochs of 12 steps."""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stepwatch


def writer(stop: threading.Event) -> None:
    """A checkpoint writer on its own thread: its scopes are its thread's track."""
    n = 0
    while not stop.wait(0.02):
        with stepwatch.scope("checkpoint_write", n=n):
            sum(range(20_000))
        n += 1


def main() -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(12 * 16 * world, 8)
    y = x.sum(dim=1, keepdim=True)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank) if distributed else None
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    stop = threading.Event()
    thread = threading.Thread(target=writer, args=(stop,), name="checkpoint-writer")
    thread.start()
    try:
        for epoch in range(2):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for xb, yb in loader:
                loss = nn.functional.mse_loss(model(xb), yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                with stepwatch.scope("clip_grads", max_norm=1.0):
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                stepwatch.mark("loss", loss.item())
    finally:
        stop.set()
        thread.join()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
