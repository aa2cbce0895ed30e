"""Multi-task training holding one head's graph at a time, on scikit-learn's digits.

A shared encoder feeds three heads: digit classification, regression of the digit's mean
ink, and reconstruction of the 8x8 image. ``acc.backward_heads`` back-propagates each head
into the cached encoder output in turn, then the encoder once, inside accumulation windows
that ramp from 1 to 4 micro-batches. At the end it prints the autograd graph memory of one
step against the joint ``(loss_a + loss_b + loss_c).backward()``.

    pip install -e ".[examples]" && python examples/multitask.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, Ramp
from lightning_accum.multitask import backward_heads, measure_graph_memory

from _quiet import quiet


class MultiTask(AccumulationMixin, pl.LightningModule):
    WEIGHTS = (1.0, 0.5, 0.5)

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU())
        self.classify = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
        self.ink = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))
        self.reconstruct = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64))
        self.configure_accumulation(Ramp(1, 4, over=2000, unit="samples"), gradient_clip_val=1.0)

    def head_losses(self, x: Tensor, y: Tensor) -> list[Callable[[Tensor], Tensor]]:
        return [
            lambda f: nn.functional.cross_entropy(self.classify(f), y),
            lambda f: nn.functional.mse_loss(self.ink(f).squeeze(-1), x.mean(dim=1)),
            lambda f: nn.functional.mse_loss(self.reconstruct(f), x),
        ]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        with self.accumulate(batch) as acc:
            losses = acc.backward_heads(self.encoder(x), self.head_losses(x, y), weights=self.WEIGHTS)
        self.log_dict(dict(zip(("cls", "ink", "rec"), losses, strict=True)), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def graph_memory(model: MultiTask, x: Tensor, y: Tensor, sequential: bool) -> int:
    """Peak bytes saved for backward during one step, joint or head by head."""
    with measure_graph_memory(exclude=model.parameters()) as memory:
        features = model.encoder(x)
        heads = model.head_losses(x, y)
        if sequential:
            backward_heads(lambda loss: loss.backward(), features, heads, model.WEIGHTS)
        else:
            sum(w * head(features) for w, head in zip(model.WEIGHTS, heads, strict=True)).backward()
    model.zero_grad(set_to_none=True)
    return memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 2, or 5 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    args = parser.parse_args()
    args.epochs = args.epochs or (5 if args.full else 2)
    quiet()

    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    model = MultiTask()
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
    with torch.no_grad():
        accuracy = (model.classify(model.encoder(x)).argmax(-1) == y).float().mean()
    metrics = trainer.callback_metrics
    print(
        f"{model.accumulation_progress.step} optimizer steps; last losses: cls {float(metrics['cls']):.3f} "
        f"ink {float(metrics['ink']):.4f} rec {float(metrics['rec']):.4f}; train accuracy {float(accuracy):.3f}"
    )
    joint = graph_memory(model, x[:256], y[:256], sequential=False)
    sequential = graph_memory(model, x[:256], y[:256], sequential=True)
    print(
        f"autograd graph memory of one step (256 samples): joint backward {joint / 2**20:.2f} MiB, "
        f"backward_heads {sequential / 2**20:.2f} MiB ({100 * (1 - sequential / joint):.0f} % saved)"
    )


if __name__ == "__main__":
    main()
