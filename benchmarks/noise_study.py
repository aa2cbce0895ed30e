"""How far the adaptive k lands from the truth: ``AccumulationScheduler(NoiseScale(2, 64))`` with
default arguments on a linear regression whose noise scale is known in closed form.

x ~ N(0, I_21), y = x . w* + N(0, 2); the model sits at w* + delta with |delta| = 1 and a learning
rate of 0, so the truth stays put: |G|^2 = 1, tr(Sigma) = (d + 1) + d sigma^2 = 64 = B_simple.
Micro-batches of 4 samples, so the right k is 16; 24k samples per seed (6000 micro-batches).
Writes a table (per seed: final k, final estimate of B_simple) and a PNG of the estimate and k
against the samples seen. The script uses only the public API, so it runs unchanged on older
versions (``PYTHONPATH=old/src python benchmarks/noise_study.py --label before``).

    python benchmarks/noise_study.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, NoiseScale

D, SIGMA2, B, SAMPLES, TRUE_K = 21, 2.0, 4, 24_000, 16
HERE = Path(__file__).resolve().parent


class Regressor(pl.LightningModule):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return 0.5 * (x @ self.w - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Trace(pl.Callback):
    """The estimate of B_simple and k after every optimizer step."""

    def __init__(self, schedule: NoiseScale) -> None:
        self.schedule, self.rows = schedule, []  # type: ignore[var-annotated]
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += B
        self.rows.append((self.seen, self.schedule.noise_scale, self.schedule.k(trainer.callbacks[0].progress)))


def run(seed: int) -> list[tuple[int, float, int]]:
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    delta = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(SAMPLES, D, generator=g, dtype=torch.float64)
    y = x @ w_star + math.sqrt(SIGMA2) * torch.randn(SAMPLES, generator=g, dtype=torch.float64)
    schedule = NoiseScale(2, 64)
    trace = Trace(schedule)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[AccumulationScheduler(schedule, log=False), trace],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(w_star + delta / delta.norm()), DataLoader(TensorDataset(x, y), batch_size=B))
    return trace.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--label", default="after")
    parser.add_argument("--json", type=Path, default=HERE / "noise_study.json")
    parser.add_argument("--png", default=str(HERE.parent / "docs" / "images" / "noise_study.png"), help="'' for none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    traces = {seed: run(seed) for seed in range(args.seeds)}
    rows = []
    print(f"{'seed':>4}{'final k':>9}{'B_simple est.':>15}{'k error':>9}")
    for seed, trace in traces.items():
        _, estimate, k = trace[-1]
        rows.append({"seed": seed, "k": k, "estimate": estimate, "k_error": k / TRUE_K - 1})
        print(f"{seed:>4}{k:>9}{estimate:>15.1f}{k / TRUE_K - 1:>+9.0%}")
    within = sum(abs(r["k_error"]) <= 0.25 for r in rows)  # type: ignore[arg-type]
    print(f"{within}/{len(rows)} seeds within 25 % of k = {TRUE_K} (target: all)")
    result = {"benchmark": "noise_study", "label": args.label, "rows": rows, "within_25": within}
    args.json.write_text(json.dumps(result, indent=2))
    if args.png:
        plot(traces, Path(args.png), args.label)


def plot(traces: dict[int, list[tuple[int, float, int]]], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, constrained_layout=True)
    for seed, trace in traces.items():
        seen = [r[0] for r in trace]
        top.plot(seen, [r[1] for r in trace], lw=1, label=f"seed {seed}")
        bottom.plot(seen, [r[2] for r in trace], lw=1)
    top.axhline(B * TRUE_K, color="k", ls="--", lw=1, label="truth")
    top.axhspan(0.75 * B * TRUE_K, 1.25 * B * TRUE_K, color="0.9")
    top.set(ylabel="estimated B_simple (samples)", ylim=(0, 4 * B * TRUE_K), title=f"NoiseScale defaults ({label})")
    top.legend(ncol=3, fontsize=8)
    bottom.axhline(TRUE_K, color="k", ls="--", lw=1)
    bottom.axhspan(0.75 * TRUE_K, 1.25 * TRUE_K, color="0.9")
    bottom.set(xlabel="samples seen", ylabel="k (micro-batches of 4)")
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
