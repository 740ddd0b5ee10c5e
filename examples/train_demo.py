"""A small CPU training run: an MLP learning a noisy sine, data-parallel over the ranks torchrun
starts (gloo), a few hundred steps.

Plain PyTorch. Under ``stepwatch run`` (or ``track``) it is captured with no code change: the
steps, their phases and the memory of every rank are inferred. The two stepwatch calls only add
detail: a loss mark on each step and progress records in the heartbeat.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stepwatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per rank")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    torch.set_num_threads(1)
    steps_per_epoch = max(1, args.steps // args.epochs)
    x = torch.linspace(-math.pi, math.pi, steps_per_epoch * args.batch * world).unsqueeze(1)
    y = torch.sin(x) + 0.05 * torch.randn_like(x)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True) if distributed else None
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, shuffle=sampler is None)
    model: nn.Module = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    step = 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        started = time.perf_counter()
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            stepwatch.mark("loss", loss.item())
            step += 1
            if step % 20 == 0:
                elapsed = time.perf_counter() - started
                stepwatch.progress(step, loss=loss.item(), toks_per_s=20 * args.batch * world / elapsed)
                started = time.perf_counter()
        with torch.no_grad():
            val = nn.functional.mse_loss(model(x[::7]), y[::7]).item()
        if rank == 0:
            print(f"epoch {epoch}: step {step}, train loss {loss.item():.4f}, val loss {val:.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
