"""``StepProgressBar`` on 2 gloo ranks: the totals (the epoch's and the fit's) from a schedule keyed on the samples
of both ranks are the windows the fit runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_accum import AccumulationScheduler, Ramp
from lightning_accum.progress import StepProgressBar

from helpers import TokenData, TokenModel, loader, trainer

pytestmark = pytest.mark.slow


class Report(pl.Callback):
    """Rank 0's bar (the one drawn): its total at each epoch's start and its counter and total at the end,
    beside the windows the fit announced."""

    def __init__(self, bar: StepProgressBar, out: Path) -> None:
        self.bar, self.out, self.epochs = bar, out, []  # type: ignore[var-annotated]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.epochs.append({"first": self.bar.train_progress_bar.total, "steps": 0})

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        self.epochs[-1]["steps"] += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.epochs[-1]["last"] = [self.bar.train_progress_bar.n, self.bar.train_progress_bar.total]
        self.epochs[-1]["postfix"] = getattr(self.bar.train_progress_bar, "postfix", None)  # (rank 0 draws)
        if trainer.is_global_zero:
            (self.out / "rank0.json").write_text(json.dumps(self.epochs))


def test_two_ranks(tmp_path: Path) -> None:
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    bar = StepProgressBar()
    callbacks = [AccumulationScheduler(Ramp(1, 4, over=100, unit="samples")), bar, Report(bar, tmp_path)]
    t = trainer(
        callbacks=callbacks, max_epochs=2, devices=2, strategy=strategy, enable_progress_bar=True,
        use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(TokenModel(), loader(TokenData(62), 4, sharded=True))  # 31 samples per rank: the last batch holds 3
    epochs = json.loads((tmp_path / "rank0.json").read_text())
    steps = [e["steps"] for e in epochs]
    # 8 samples a batch over both ranks (6 in the last): k = 1 for the batches at 0..32 samples, 2 from 40 (two
    # windows, the second cut by the epoch's end), then 2, 3, 3 from 62 samples on
    assert steps == [7, 3]
    assert [e["first"] for e in epochs] == steps
    assert [e["last"] for e in epochs] == [[n, n] for n in steps]
    # the fit's steps, its total walked at the start with the samples of both ranks
    assert [e["postfix"].split(",")[0] for e in epochs] == ["step=7/10", "step=10/10"]
