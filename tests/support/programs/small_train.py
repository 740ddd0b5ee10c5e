"""A tiny CPU training loop whose slowness and end are chosen on the command line, for the real
runs the verdicts and the surfaces read: a slow loader (from the start or from a step on), one slow
rank (DDP over gloo when launched with several ranks), a growing list of tensors (on every rank or
on one), a sleep after each step (a run slow enough to watch grow), host work inside each step, rank
0's work between steps while the others wait at a barrier, a NaN loss, a raise or a SIGKILL at a
step. Plain PyTorch: no stepwatch call."""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset):
    def __init__(self, size: int, item_ms: float = 0.0) -> None:
        self.x = torch.randn(size, 8)
        self.y = torch.randn(size, 1)
        self.item_ms = item_ms

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.item_ms:
            time.sleep(self.item_ms / 1000)
        return self.x[i], self.y[i]


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
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--slow-loader-ms", type=float, default=0.0, help="sleep in each batch's collate")
    parser.add_argument("--slow-loader-after", type=int, default=0, help="the loader turns slow from this step")
    parser.add_argument("--slow-item-ms", type=float, default=0.0, help="sleep in each item's __getitem__")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-forward-ms", type=float, default=0.0)
    parser.add_argument("--forward-ms", type=float, default=0.0, help="every rank sleeps this long in forward")
    parser.add_argument("--leak-mb", type=float, default=0.0, help="MiB kept alive after each step")
    parser.add_argument("--leak-rank", type=int, default=-1, help="only this rank keeps them (-1: every rank)")
    parser.add_argument("--sleep-after-step-ms", type=float, default=0.0)
    parser.add_argument("--checkpoint-ms", type=float, default=0.0,
                        help="after each step rank 0 works this long (a checkpoint) while the others wait at dist.barrier()")
    parser.add_argument("--host-work-ms", type=float, default=0.0,
                        help="host work inside each step, between its forward and its backward (logging, a metric)")
    parser.add_argument("--nan-at", type=int, default=-1, help="the loss is NaN at this step (a NONFINITE alert)")
    parser.add_argument("--crash-at", type=int, default=-1, help="raise at this step")
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself at this step")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    step = 0

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if args.slow_loader_ms and step >= args.slow_loader_after:
            time.sleep(args.slow_loader_ms / 1000)
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    loader = DataLoader(Numbers(args.steps * args.batch, args.slow_item_ms), batch_size=args.batch, collate_fn=collate,
                        num_workers=args.workers)
    forward_ms = args.forward_ms + (args.slow_forward_ms if rank == args.slow_rank else 0.0)
    model: nn.Module = SlowOn(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), forward_ms)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    for xb, yb in loader:
        if step == args.crash_at:
            raise RuntimeError(f"bad batch at step {step} on rank {rank}")
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(xb), yb)
        if step == args.nan_at:
            loss = loss * float("nan")
        if args.host_work_ms:
            time.sleep(args.host_work_ms / 1000)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if args.leak_mb and args.leak_rank in (-1, rank):
            kept.append(torch.ones(int(args.leak_mb * 2**20 / 4)))
        if args.sleep_after_step_ms:
            time.sleep(args.sleep_after_step_ms / 1000)
        if args.checkpoint_ms:
            if rank == 0:
                time.sleep(args.checkpoint_ms / 1000)
            if distributed:
                dist.barrier()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
