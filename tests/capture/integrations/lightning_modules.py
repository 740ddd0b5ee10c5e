"""The LightningModules the Lightning and autoattach tests fit. A module of their own, which the tests import
when they run (``tests.support.lazy``): defining them imports Lightning, and a test module's top
is imported by every worker that collects it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

import stepwatch


class Boom(Exception):
    """The user's own error."""


class TinyModule(pl.LightningModule):
    """A linear regressor; ``fail_at`` raises Boom in that batch, ``trace`` wraps each step in
    ``stepwatch.trace_step`` as a user porting a plain-torch loop would."""

    def __init__(self, *, fail_at: int | None = None, trace: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.trace = trace
        self.boom: Boom | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trace:
            with stepwatch.trace_step(self):
                stepwatch.mark("user_mark", batch_idx)
                return self._step(batch, batch_idx)
        return self._step(batch, batch_idx)

    def _step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_at == batch_idx:
            self.boom = Boom("user code failed")
            raise self.boom
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return {"loss": loss}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ManualModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return {"loss": loss.detach()}


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ValidatedRegressor(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y))
