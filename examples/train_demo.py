"""A small CPU training run: an MLP learning a noisy sine, a few hundred steps.

Plain PyTorch plus two optional stepwatch calls (phases and progress). Under
``stepwatch track`` it is captured with no code change at all; the calls only add detail.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import stepwatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.linspace(-math.pi, math.pi, 8192).unsqueeze(1)
    y = torch.sin(x) + 0.05 * torch.randn_like(x)
    model = nn.Sequential(nn.Linear(1, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    steps_per_epoch = max(1, args.steps // args.epochs)
    step = 0
    for epoch in range(args.epochs):
        with stepwatch.phase("train", epoch=epoch):
            for _ in range(steps_per_epoch):
                started = time.perf_counter()
                with stepwatch.phase("data_load"):
                    index = torch.randint(0, x.shape[0], (args.batch,))
                    xb, yb = x[index], y[index]
                with stepwatch.phase("forward"):
                    loss = nn.functional.mse_loss(model(xb), yb)
                with stepwatch.phase("backward"):
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                with stepwatch.phase("optimizer_step"):
                    optimizer.step()
                step += 1
                if step % 10 == 0:
                    stepwatch.progress(step, loss=loss.item(), toks_per_s=args.batch / (time.perf_counter() - started))
        with stepwatch.phase("evaluate", epoch=epoch), torch.no_grad():
            val = float(nn.functional.mse_loss(model(x), y))
        print(f"epoch {epoch}: step {step}, train loss {loss.item():.4f}, val loss {val:.4f}", flush=True)


if __name__ == "__main__":
    main()
