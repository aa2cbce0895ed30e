"""Quickstart: a batch-size ramp on scikit-learn's bundled digits (no download).

The effective batch grows from 16 to 128 samples over the first 3,000 samples seen, by
accumulating 1 to 8 micro-batches of 16; the learning rate follows the square-root rule.
Every optimizer step (window) prints its k, effective batch, mean loss and accuracy.

    pip install -e ".[examples]" && python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

from lightning_accum import AccumulationScheduler, Ramp

from _quiet import quiet


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr
        self.train_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc.update(logits, y)
        self.window_losses.append(float(loss.detach()))
        return loss

    def on_train_start(self) -> None:
        self.window_losses: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self.net(x), y)

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", self.val_acc.compute(), prog_bar=True)
        self.val_acc.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class PrintWindows(pl.Callback):
    """One line per optimizer step: the window's k, effective batch, mean loss and accuracy."""

    def __init__(self, accumulation: AccumulationScheduler) -> None:
        self.accumulation = accumulation
        self.samples_before = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        progress = self.accumulation.progress
        if progress.samples == self.samples_before:  # the window is still open
            return
        k = len(module.window_losses)
        effective = progress.samples - self.samples_before
        loss = sum(module.window_losses) / k
        print(
            f"epoch {trainer.current_epoch}  step {progress.step:4d}  k {k}  effective batch {effective:4d}  "
            f"loss {loss:.4f}  acc {float(module.train_acc.compute()):.3f}"
        )
        module.window_losses.clear()
        module.train_acc.reset()
        self.samples_before = progress.samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    quiet()

    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, val = random_split(TensorDataset(x, y), [1500, len(x) - 1500], generator=torch.Generator().manual_seed(0))

    accumulation = AccumulationScheduler(Ramp(1, 8, over=3000, unit="samples"), lr_scaling="sqrt")
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        callbacks=[accumulation, PrintWindows(accumulation)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    model = DigitsClassifier()
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=256))
    print(
        f"done: {accumulation.progress.step} optimizer steps, {accumulation.progress.samples} samples, "
        f"validation accuracy {float(trainer.callback_metrics['val_acc']):.3f}"
    )


if __name__ == "__main__":
    main()
