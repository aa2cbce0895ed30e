"""Adaptive accumulation from the gradient noise scale, on scikit-learn's digits.

``NoiseScale(2, 32)`` starts with windows of 2 micro-batches of 16 and sets k from the measured
critical batch size B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018). On this small problem the
estimate moves with training without a trend (mostly between 40 and 200 samples, with peaks near
300-400), and k follows it, between 2 and 14 micro-batches. ``lr_scaling="adascale"`` sets each
step's learning rate by AdaScale's gain r = (tr(Sigma)/B0 + |G|^2) / (tr(Sigma)/B + |G|^2) from the
same measurements (Johnson et al. 2020): between 1 (little noise: a bigger batch barely helps) and
B/B0 (noise dominates: the linear rule). Prints k, the estimate and r every few steps and writes
``adaptive.png`` (k, the noise scale, r and the learning rate over training) into ``--out``. An
epoch's last window holds fewer micro-batches when the epoch runs out of batches: the plot marks
those windows, whose smaller batch also gets a smaller gain (the dips in r), and "final k" is the
schedule's k, not theirs.

    pip install -e ".[examples]" && python examples/adaptive.py --out .
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

from lightning_accum import AccumulationScheduler, NoiseScale

from _quiet import quiet


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Track(pl.Callback):
    """At every optimizer step: the schedule's k, the micro-batches the window really held (an
    epoch's last window is short when the epoch runs out of batches), the noise scale, AdaScale's
    gain and the learning rate."""

    def __init__(self, accumulation: AccumulationScheduler, schedule: NoiseScale) -> None:
        self.accumulation, self.schedule = accumulation, schedule
        self.steps: list[int] = []
        self.k: list[int] = []  # the schedule's k for the window
        self.held: list[int] = []  # micro-batches the window held
        self.noise: list[float] = []
        self.gain: list[float] = []
        self.lr: list[float] = []
        self._k_now = schedule.current_k

    def on_train_batch_start(self, *args: Any) -> None:
        self._k_now = self.schedule.current_k  # (the window under way got it when it opened)

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        self.lr.append(optimizer.param_groups[0]["lr"])  # (after the package scaled it for this step)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        progress = self.accumulation.progress
        if progress.step == len(self.steps):  # the window is still open
            return
        self.steps.append(progress.step)
        self.k.append(self._k_now)
        self.held.append(progress.microbatches - sum(self.held))
        self.noise.append(self.schedule.noise_scale)
        self.gain.append(progress.scaled_steps - sum(self.gain))
        if progress.step % 10 == 0:
            short = f" (held {self.held[-1]}: the epoch's last)" if self.held[-1] < self.k[-1] else ""
            print(
                f"step {progress.step:4d}  k {self.k[-1]:2d}{short}  noise scale {self.noise[-1]:8.1f} samples  "
                f"adascale gain {self.gain[-1]:5.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None, help="default 3, or 8 with --full")
    parser.add_argument("--full", action="store_true", help="the full run (several minutes on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    args.epochs = args.epochs or (8 if args.full else 3)
    quiet()

    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    data = DataLoader(TensorDataset(x, torch.tensor(digits.target)), batch_size=16, shuffle=True)
    schedule = NoiseScale(2, 32, every=5, warmup=5, beta=0.9)
    accumulation = AccumulationScheduler(schedule, lr_scaling="adascale")
    track = Track(accumulation, schedule)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        callbacks=[accumulation, track],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), data)
    progress = accumulation.progress
    short = sum(h < k for h, k in zip(track.held, track.k, strict=True))
    print(
        f"done: {progress.step} optimizer steps ({short} short windows at epoch ends), "
        f"{progress.scaled_steps:.1f} scaled steps, final k {schedule.current_k}"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, sharex=True, figsize=(7, 8), layout="constrained")
    top.step(track.steps, track.k, where="post", label="the schedule's k")
    short = [(s, h) for s, h, k in zip(track.steps, track.held, track.k, strict=True) if h < k]
    if short:
        top.plot(*zip(*short, strict=True), "v", color="tab:red", label="an epoch's short last window")
    top.set(ylabel="micro-batches of 16")
    top.set_ylim(top=max(track.k) * 1.35)  # (room for the legend above the curve)
    top.legend(loc="upper left", ncol=2)
    middle.plot(track.steps, track.noise)
    middle.set(ylabel="noise scale\nB_simple (samples)")
    bottom.plot(track.steps, track.gain, label="AdaScale gain r")
    bottom.plot(track.steps, [lr / 0.1 for lr in track.lr], "--", label="learning rate / 0.1")
    dips = [(s, g) for s, g, h, k in zip(track.steps, track.gain, track.held, track.k, strict=True) if h < k]
    if dips:  # a short window is a smaller batch: a smaller gain, a smaller step
        bottom.plot(*zip(*dips, strict=True), "v", color="tab:red", label="short last window")
    bottom.set(xlabel="optimizer step", ylabel="gain")
    bottom.set_ylim(top=max(track.gain) * 1.35)
    bottom.legend(loc="upper left", ncol=3)
    fig.align_ylabels()
    top.set_title("Accumulation and learning rate following the gradient noise (digits)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "adaptive.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
