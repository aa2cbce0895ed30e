"""Gradient decay instead of zeroing, on scikit-learn's digits: loss curves of four runs.

The same classifier is trained four times from the same seed: with ``zero_grad`` (plain
Lightning), with ``GradientDecay(0.5)`` (``p.grad *= 0.5`` instead of zeroing: the gradient
keeps a decaying sum of earlier steps), with ``GradientDecay(0.9, mode="ema",
bias_correction=True)`` (an exponential moving average of gradients), and with ``zero_grad`` at
twice the learning rate (the sum's effective step, below). It prints each run's mean loss over
its last epoch and writes ``gradient_decay.png`` (the loss curves) into ``--out``.

Read the curves at equal step size. Under plain SGD, ``mode="sum"`` with factor f sums the
gradient over past steps with weights 1, f, f^2, ...: for slowly changing gradients that is
``g / (1 - f)``, so factor 0.5 roughly doubles the effective learning rate (it is SGD with
momentum 0.5 and no dampening). Its faster curve is mostly the larger step, not "decay is
better": the fourth run, ``zero_grad`` at twice the learning rate, is the fair comparison.
``mode="ema"`` (weights summing to 1) keeps the step size.

    pip install -e ".[examples]" && python examples/gradient_decay.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import GradientDecay

from _quiet import quiet


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def train(policy: GradientDecay | None, lr: float, data: DataLoader[Any], epochs: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    model = Classifier(lr)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[] if policy is None else [policy],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return model.losses


def smooth(values: list[float], width: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 3, or 6 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    args.epochs = args.epochs or (6 if args.full else 3)
    quiet()

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    generator = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(x, torch.tensor(digits.target)), batch_size=32, shuffle=True, generator=generator)
    lr = 0.05
    runs = {
        "zero_grad": (None, lr),
        "GradientDecay(0.5), sum": (GradientDecay(0.5), lr),
        "GradientDecay(0.9), ema + bias correction": (GradientDecay(0.9, mode="ema", bias_correction=True), lr),
        "zero_grad, lr x 2 (the sum's effective step)": (None, lr / (1 - 0.5)),
    }
    curves = {}
    for name, (policy, run_lr) in runs.items():
        generator.manual_seed(0)
        curves[name] = train(policy, run_lr, data, args.epochs)
        last = curves[name][-len(data) :]
        print(f"{name:<46} mean loss over the last epoch {sum(last) / len(last):.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(smooth(losses), ":" if "lr x 2" in name else "-", label=name)
    ax.set(xlabel="optimizer step", ylabel="training loss (moving average of 20)", yscale="log")
    ax.set_title("Digits classifier: zeroing vs decaying the gradient")
    ax.legend()
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gradient_decay.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
