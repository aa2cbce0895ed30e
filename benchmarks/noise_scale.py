"""Overhead of measuring the gradient noise scale: AccumulationScheduler with a constant k
against the same k from ``NoiseScale(k, k)`` (same windows, plus a squared norm after every
micro-batch, the fit and one small all-reduce per window), and the probe's own cost per window.

An MLP 256-1024-1024-10 on batches of 32, 1200 batches per run, interleaved rounds; the figure
is the ratio of the best training-loop CPU times.

    python benchmarks/noise_scale.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import timed_epoch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, Constant, NoiseScale, Schedule
from lightning_accum._core.gradients import squared_norm
from lightning_accum._core.probe import NoiseProbe, measured
from lightning_accum._core.window import Window


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SingleDevice:
    world_size = 1
    root_device = torch.device("cpu")


def timed(schedule: Schedule, data: DataLoader[Any]) -> float:
    return timed_epoch(MLP(), data, [AccumulationScheduler(schedule, log=False)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("noise_scale.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batches * 32, 256, generator=g), torch.randint(0, 10, (args.batches * 32,), generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    rows = []
    print(f"{'k':>3}{'constant s':>12}{'noise scale s':>15}{'ratio':>8}")
    for k in (4, 8):
        best = {"constant": float("inf"), "noise": float("inf")}
        for _ in range(args.rounds + 1):
            best["constant"] = min(best["constant"], timed(Constant(k), data))
            best["noise"] = min(best["noise"], timed(NoiseScale(k, k), data))
        row = {
            "k": k,
            "constant_s": best["constant"],
            "noise_s": best["noise"],
            "ratio": best["noise"] / best["constant"],
        }
        rows.append(row)
        print(f"{k:>3}{row['constant_s']:>12.3f}{row['noise_s']:>15.3f}{row['ratio']:>8.3f}")
    # the probe's own cost, measured directly (single loop runs on a shared machine vary by several %)
    model = MLP()
    xb, yb = x[:32], y[:32]
    start = time.perf_counter()
    for _ in range(50):
        model.training_step((xb, yb), 0).backward()
    batch_ms = (time.perf_counter() - start) / 50 * 1e3
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for row in rows:
        k = row["k"]
        probe = NoiseProbe(NoiseScale(k, k), "mean")
        start = time.perf_counter()
        for _ in range(100):  # one window: a norm after each micro-batch but the last, the fit at the end
            window = Window(k=k, divisor=k)
            for _ in range(k - 1):
                window.add(32, 32)
                if measured(window.microbatches):
                    probe.prefix(grads, window)
            # (in a fit the prefixes and this norm are read with the window's counts, in one transfer)
            probe.window_end(SingleDevice(), float(squared_norm(grads)), [k, 32 * k, 32 * k])
        probe_ms = (time.perf_counter() - start) / 100 * 1e3
        row["probe_ms_per_window"] = probe_ms
        row["probe_fraction"] = probe_ms / (k * batch_ms)
        print(
            f"k={k}: probe {probe_ms:.3f} ms per window = "
            f"{100 * row['probe_fraction']:.2f} % of the window's forward+backward"
        )
    print("target: ratio <= 1.03")
    args.json.write_text(json.dumps({"benchmark": "noise_scale", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
