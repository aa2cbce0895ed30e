"""Host work per refresh of ``StepProgressBar`` and ``RichStepProgressBar``, in place, against Lightning's own
``TQDMProgressBar`` and ``RichProgressBar``; and the one walk of the fit's windows at its start.

One short fit of a tiny MLP (batches of 8, one CPU thread) runs with each bar, its output thrown away; then,
with the fit's real trainer, module and last ``WindowReport``, each bar's refresh is replayed and timed outside
Lightning's loop:

* ``lightning``: ``TQDMProgressBar.on_train_batch_end``, Lightning's refresh per batch (the baseline);
* ``lightning, the same fields``: the same, drawing the fields ``StepProgressBar`` adds to the postfix (set once:
  what drawing them costs Lightning's own bar);
* ``steps, exact``: ``StepProgressBar.on_window_end`` (``unit="steps"``) under a ramp over samples, whose total
  is known from the epoch's start: the counts (the epoch's and the fit's), the postfix, the draw;
* ``steps, found per window``: the same under a ramp over items (with a ``count``), whose total is worked out
  again at each window's end;
* ``count only``: ``BarCount.window_end`` alone (what the bar adds before drawing);
* ``fit's steps only``: ``FitCount.window_end`` and the postfix's ``step=done/total`` (what the fit's figure adds);
* ``rich: lightning`` and ``rich: steps, exact``: the same two with Rich (``RichProgressBar.on_train_batch_end``,
  the baseline of ``RichStepProgressBar.on_window_end``, which also moves the overall bar);
* ``fit total at start``: ``FitCount.start_fit``, once per fit: the walk of the whole fit's windows (a ramp over
  samples, 1000 batches an epoch, ``--epochs`` epochs), in microseconds per fit and per window walked.

The calls are timed in interleaved rounds (each round times every call in turn): each time is the best round's
mean (a busy machine only adds time); the ratio is the median over rounds of the time against ``lightning`` (or
``rich: lightning``) in the same round, beside the ratio of the best rounds. Nothing here reads a device
(``tests/test_host_reads.py`` counts that).

    python benchmarks/progress_bar.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler, Progress, Ramp
from lightning_accum._trainer import steps
from lightning_accum._trainer.fit_count import FitCount
from lightning_accum.progress import RichStepProgressBar, StepProgressBar


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SameFields(pl.callbacks.TQDMProgressBar):
    """Lightning's bar drawing the fields ``StepProgressBar``'s postfix adds (the fit's steps, ``k``, ``batch``, the
    loss in place of ``accum/loss`` and the throughput), set once: Lightning's cost of the same postfix."""

    fields: dict[str, Any] = {"step": "9/9", "k": "6", "batch": "48", "samples/s": "3806"}

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        return {**self.fields, "loss": metrics.pop("accum/loss", None), **metrics}


class Last(pl.Callback):
    def __init__(self) -> None:
        self.window: Any = None

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        self.window = window


def fitted(bar: Any, schedule: Any, count: Any = None) -> tuple[pl.Trainer, Any, Any]:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    last = Last()
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[AccumulationScheduler(schedule, count=count), bar, last], logger=False,
        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    module = MLP()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(module, data)
    return trainer, module, last.window


def interleaved(calls: dict[str, Any], base: str, reps: int, rounds: int) -> list[dict[str, Any]]:
    """Each call's mean over ``reps`` calls, in microseconds, in ``rounds`` rounds that time every call in turn: the
    best round's (a busy machine only adds time), and the median over rounds of the ratio to ``base`` timed in the
    same round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    with contextlib.redirect_stderr(io.StringIO()):
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                for i in range(reps):
                    call(i)
                times[name].append((time.perf_counter() - start) / reps * 1e6)
    rows = []
    for name, taken in times.items():
        ratios = sorted(t / b for t, b in zip(taken, times[base], strict=True))
        rows.append({"run": name, "us": min(taken), "ratio": ratios[len(ratios) // 2], "ratio_best": min(taken)
                     / min(times[base])})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=10, help="of the walk at the fit's start (1000 batches each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lightning_bar = pl.callbacks.TQDMProgressBar()
    trainer, module, _ = fitted(lightning_bar, 4)
    calls: dict[str, Any] = {
        "lightning": lambda i, t=trainer, m=module: lightning_bar.on_train_batch_end(t, m, None, None, i)
    }
    same = SameFields()
    trainer, module, _ = fitted(same, 4)
    calls["lightning, the same fields"] = lambda i, t=trainer, m=module: same.on_train_batch_end(t, m, None, None, i)
    for name, schedule, count in (
        ("steps, exact", Ramp(1, 8, over=128, unit="samples"), None),
        ("steps, found per window", Ramp(1, 8, over=512, unit="items"), lambda batch: 2 * len(batch[0])),
    ):
        bar = StepProgressBar()
        trainer, module, window = fitted(bar, schedule, count)
        calls[name] = lambda i, b=bar, t=trainer, m=module, w=window: b.on_window_end(t, m, w)
    calls["count only"] = lambda i, b=bar, t=trainer, w=window: b._count.window_end(t, w)
    calls["fit's steps only"] = lambda i, b=bar, w=window: (b._fit.window_end(w), b._fit.text())
    rows = interleaved(calls, "lightning", args.reps, args.rounds)
    console = {"file": io.StringIO(), "width": 200}
    rich = pl.callbacks.RichProgressBar(console_kwargs=console)
    trainer, module, _ = fitted(rich, 4)
    calls = {"rich: lightning": lambda i, t=trainer, m=module: rich.on_train_batch_end(t, m, None, None, i)}
    rich_bar = RichStepProgressBar(console_kwargs=console)
    trainer, module, window = fitted(rich_bar, Ramp(1, 8, over=128, unit="samples"))
    calls["rich: steps, exact"] = lambda i, t=trainer, m=module, w=window: rich_bar.on_window_end(t, m, w)
    rows += interleaved(calls, "rich: lightning", args.reps, args.rounds)
    for row in rows:
        print(f"{row['run']:>26}: {row['us']:8.1f} us per refresh (best round); {row['ratio']:.3f} x Lightning's "
              f"(median of rounds), {row['ratio_best']:.3f} (best rounds)")  # fmt: skip
    start = fit_start(args.epochs, max(1, args.rounds))
    print(f"{'fit total at start':>26}: {start['us']:8.0f} us per fit, {start['us_per_window']:.2f} us per window "
          f"({start['windows']} windows)")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "fit_start": start}, indent=1))


class Walked:
    """What ``FitCount.start_fit`` reads of a Trainer: a sized loader of 1000 batches of 8, ``epochs`` epochs."""

    def __init__(self, epochs: int) -> None:
        self.max_steps, self.max_epochs, self.num_training_batches, self.world_size = -1, epochs, 1000, 1
        self.train_dataloader = DataLoader(TensorDataset(torch.zeros(8000, 1)), batch_size=8)


def fit_start(epochs: int, rounds: int) -> dict[str, Any]:
    """``FitCount.start_fit`` under a ramp over samples (k 1 to 8 over the first 40 000 samples): the best time."""
    schedule = Ramp(1, 8, over=40_000, unit="samples")
    found = steps.Accumulating(schedule, False, "mean", lambda: Progress())
    trainer, count = Walked(epochs), FitCount()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        count.start_fit(trainer, found)
        times.append((time.perf_counter() - start) * 1e6)
    return {"us": min(times), "windows": int(count.total), "us_per_window": min(times) / count.total}


if __name__ == "__main__":
    main()
