"""BatchNorm's running statistics under accumulation, on scikit-learn's digits: per micro-batch vs per window.

A small convolutional network (two conv + BatchNorm2d blocks) is trained three times from the same seed on
the same samples in the same order: with one big batch of 128 per optimizer step (no accumulation), and with
k = 8 micro-batches of 16 per step through ``AccumulationScheduler``, once with BatchNorm's default update
(``batchnorm="micro-batch"``: the running statistics move at every micro-batch, from 16 samples, the momentum
applied 8 times per step) and once with ``batchnorm="window"`` (one update per window, from its 128 samples).
After every optimizer step it compares the first BatchNorm layer's running mean and variance with the
big-batch run's (relative distance), prints the figures and writes ``batchnorm_window.png`` into ``--out``.

The two accumulated runs have the very same parameters (the forward is untouched: each micro-batch is
normalised by its own statistics, "ghost batch norm"), so what differs between them is the running
statistics alone; both drift a little from the big-batch run's parameters, for the same reason. Last, from
the window run's final weights, one more window is run in float64 through ``FabricAccumulator`` and compared
with one forward of its 128 samples as a single batch: the first BatchNorm layer's running statistics agree to
rounding; the second layer's differ a little, as it is given activations normalised per micro-batch.

    pip install -e ".[examples]" && python examples/batchnorm_window.py
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_accum import AccumulationScheduler
from lightning_accum.fabric import FabricAccumulator

from _quiet import quiet

K, MICRO = 8, 16  # micro-batches per window, samples per micro-batch


def make_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FirstBatchNorm(pl.Callback):
    """The first BatchNorm layer's running mean and variance after each optimizer step (read at the next
    batch's start and at the end, once every callback has finished the step)."""

    def __init__(self) -> None:
        self.means: list[Tensor] = []
        self.variances: list[Tensor] = []
        self._seen = 0

    def _read(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            layer: nn.BatchNorm2d = pl_module.net[1]  # type: ignore[index, assignment]
            assert layer.running_mean is not None and layer.running_var is not None
            self.means.append(layer.running_mean.detach().clone())
            self.variances.append(layer.running_var.detach().clone())

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._read(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read(trainer, pl_module)


def train(data: TensorDataset, batch: int, epochs: int, accumulate: AccumulationScheduler | None) -> tuple[Any, ...]:
    pl.seed_everything(0, verbose=False)
    model = Classifier()
    recorder = FirstBatchNorm()
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[recorder] + ([] if accumulate is None else [accumulate]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return model, recorder


def distance(a: list[Tensor], b: list[Tensor]) -> list[float]:
    """The relative distance ``|a - b| / |b|`` at each step."""
    return [float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True)]


def one_window(net: nn.Module, x: Tensor, y: Tensor) -> list[float]:
    """From ``net``'s weights, in float64: one window of ``K`` micro-batches through ``FabricAccumulator`` with
    ``batchnorm="window"`` against one forward of the window's samples as one batch. The largest difference of
    each BatchNorm layer's running statistics: the first layer's are the big batch's; the second is given
    activations each micro-batch normalised by its own statistics (the forward is untouched), which differ from
    what one forward of the big batch gives it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        whole = copy.deepcopy(net).double().train()
        whole(x.double())  # (one batch: BatchNorm's own update from all the window's samples)
        fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
        net = copy.deepcopy(net)
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
        acc = FabricAccumulator(fabric, model, optimizer, K, batchnorm="window", log=False)
        for xs, ys in zip(x.double().split(MICRO), y.split(MICRO), strict=True):
            with acc.accumulate((xs, ys)) as step:
                step.backward(nn.functional.cross_entropy(model(xs), ys))
        return [
            max(float((a - b).abs().max()) for a, b in zip(mine.buffers(), big.buffers(), strict=True))
            for mine, big in ((model.module[1], whole[1]), (model.module[4], whole[4]))
        ]
    finally:
        torch.set_default_dtype(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "images")
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(1)  # (convolutions this small run 4-5 times slower on 2 threads, which mostly wait)

    digits = load_digits()
    n = len(digits.data) // (K * MICRO) * (K * MICRO)  # whole windows: every big batch is one window's samples
    x = torch.tensor(digits.data[:n], dtype=torch.float32).reshape(n, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target[:n])
    data = TensorDataset(x, y)

    _, big = train(data, K * MICRO, args.epochs, None)
    micro_model, micro = train(data, MICRO, args.epochs, AccumulationScheduler(K))
    window_model, window = train(data, MICRO, args.epochs, AccumulationScheduler(K, batchnorm="window"))
    pairs = zip(micro_model.parameters(), window_model.parameters(), strict=True)
    same = max(float((a - b).detach().abs().max()) for a, b in pairs)
    print(f"{len(big.means)} optimizer steps of {K} x {MICRO} samples; micro-batch vs window runs: parameters "
          f"differ by {same:.1e}")  # fmt: skip

    curves = {}
    for name, run in (("batchnorm='micro-batch'", micro), ("batchnorm='window'", window)):
        mean, var = distance(run.means, big.means), distance(run.variances, big.variances)
        curves[name] = (mean, var)
        last = len(mean) // 3  # (the last third of the steps)
        print(f"{name:<24} first BatchNorm layer vs the big-batch run, relative distance over the last "
              f"{last} steps: running_mean {sum(mean[-last:]) / last:.4f}, running_var "
              f"{sum(var[-last:]) / last:.4f}")  # fmt: skip

    first, second = one_window(window_model.net, x[: K * MICRO], y[: K * MICRO])
    print(f"one more window in float64 (FabricAccumulator, batchnorm='window') vs one forward of its {K * MICRO} "
          f"samples: running statistics differ by {first:.1e} (first BatchNorm layer), {second:.1e} (second layer, "
          "given activations normalised per micro-batch)")  # fmt: skip

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, i, what in ((axes[0], 0, "running_mean"), (axes[1], 1, "running_var")):
        for name, pair in curves.items():
            ax.plot(range(1, len(pair[i]) + 1), pair[i], label=name)
        ax.set(xlabel="optimizer step", title=f"first BatchNorm layer's {what}", yscale="log")
    axes[0].set_ylabel("relative distance to the big-batch run's")
    axes[0].legend()
    fig.suptitle(f"Digits, a small CNN: k = {K} micro-batches of {MICRO} against one batch of {K * MICRO}")
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "batchnorm_window.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
