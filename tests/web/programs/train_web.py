"""A tiny CPU training loop for the dashboard's browser tests (plain PyTorch, no stepwatch call):
DDP over gloo when launched with several ranks; one rank may be slowed (a straggler), the loop
may sleep after each step (a run slow enough to watch grow), raise at a step (a crashed run), or
SIGKILL itself at a step (a killed run)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn


class SlowOn(nn.Module):
    """Sleeps ``ms`` in each forward: a rank made slower than the others."""

    def __init__(self, inner: nn.Module, ms: float) -> None:
        super().__init__()
        self.inner = inner
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms:
            time.sleep(self.ms / 1000)
        return self.inner(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--nan-at", type=int, default=-1, help="the loss is NaN at this step (a NONFINITE alert)")
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * 8, 8), torch.randn(args.steps * 8, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model: nn.Module = SlowOn(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
                              args.slow_ms if rank == args.slow_rank else 0.0)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (xb, yb) in enumerate(loader):
        if step == args.crash_at:
            raise RuntimeError(f"bad batch at step {step} on rank {rank}")
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(xb), yb)
        if step == args.nan_at:
            loss = loss * float("nan")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
