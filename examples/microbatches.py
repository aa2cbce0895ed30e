"""Micro-batches that fit: train with the batch you want on a device too small for it.

The recipe asks for a loader batch of 64 and k = 4 (an effective batch of 256), but the "device"
here has a memory budget that holds the activations of only 16 samples: a forward of more raises
``torch.OutOfMemoryError``, as CUDA does (on a GPU the budget is simply its memory, or
``torch.cuda.set_per_process_memory_fraction``). Without help that run dies at its first batch;
``AccumulationScheduler(4, microbatch_size="auto")`` halves the micro-batch until it fits (64, 32,
16) and the run ends with the same parameters as on a device with enough memory (float64 here, so
the comparison shows rounding only).

    python examples/microbatches.py [--epochs 2] [--budget 16]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler

from _quiet import quiet

HIDDEN = 64


class Classifier(pl.LightningModule):
    """An MLP on a device whose memory holds the activations of ``budget`` samples (``None``: enough)."""

    def __init__(self, budget: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, 10)).double()  # fmt: skip
        self.budget = budget
        self.widest = 0  # the most samples a forward held

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.budget is not None and len(x) > self.budget:  # what a real device does, at its own size
            raise torch.OutOfMemoryError(f"out of memory: {len(x)} samples of activations, room for {self.budget}")
        self.widest = max(self.widest, len(x))
        return nn.functional.cross_entropy(self.net(x), y)  # a mean over the samples: cut into shares exactly

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g, dtype=torch.float64)
    teacher = torch.randn(32, 10, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, (x @ teacher).argmax(1)), batch_size=64, shuffle=False)


def fit(budget: int | None, microbatch_size: Any, epochs: int) -> tuple[Classifier, AccumulationScheduler, float]:
    model = Classifier(budget)
    accumulation = AccumulationScheduler(4, microbatch_size=microbatch_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        precision="64-true",
        callbacks=[accumulation],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model, data())
    return model, accumulation, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget", type=int, default=16, help="samples whose activations fit the device")
    args = parser.parse_args()
    quiet()

    try:
        fit(args.budget, None, args.epochs)
    except torch.OutOfMemoryError as error:
        print(f"loader batch 64 on the small device, no micro-batches: {error}")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        small, accumulation, seconds = fit(args.budget, "auto", args.epochs)
    for w in seen:
        if "continuing with" in str(w.message):
            print(f"  backed off: {str(w.message).split('; ')[1]}")
    big, _, big_seconds = fit(None, None, args.epochs)

    progress = accumulation.progress
    print(f"microbatch_size='auto' on the small device: micro-batches of {small.widest} samples, "
          f"{progress.step} steps of {progress.samples // progress.step} samples, {seconds:.1f} s")  # fmt: skip
    print(f"enough memory, loader batch 64 whole: {big.widest} samples a forward, {big_seconds:.1f} s")
    pairs = zip(small.parameters(), big.parameters(), strict=True)
    gap = max(float((a - b).detach().abs().max()) for a, b in pairs)
    print(f"max parameter difference, small device vs enough memory: {gap:.1e}")


if __name__ == "__main__":
    main()
