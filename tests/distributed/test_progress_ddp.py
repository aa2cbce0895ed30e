"""``StepProgressBar`` on 2 gloo ranks: the totals (the epoch's and the fit's) from a schedule keyed on the samples
of both ranks are the windows the fit runs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_accum import AccumulationScheduler, Ramp
from lightning_accum.progress import RichStepProgressBar, StepProgressBar

from helpers import TokenData, TokenModel, loader, trainer

pytestmark = pytest.mark.slow


class Report(pl.Callback):
    """Rank 0's bar (the one drawn): its total at each epoch's start and its counter and total at the end, and the
    fit's steps (done, total), beside the windows the fit announced."""

    def __init__(self, bar: Any, out: Path) -> None:
        self.bar, self.out, self.epochs = bar, out, []  # type: ignore[var-annotated]

    def drawn(self) -> list[Any]:
        """[counter, total, fit's done, fit's total] as rank 0 draws them (TQDM's postfix, Rich's overall bar)."""
        if isinstance(self.bar, StepProgressBar):
            tq = self.bar.train_progress_bar
            done, total = tq.postfix.split(",")[0].removeprefix("step=").split("/")
            return [tq.n, tq.total, int(done), int(total)]
        task, fit = self.bar.train_progress_bar, self.bar.fit_progress_bar
        return [task.completed, task.total, fit.completed, fit.total]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            total = self.bar.train_progress_bar.total
            self.epochs.append({"first": total, "steps": 0})

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        if trainer.is_global_zero:
            self.epochs[-1]["steps"] += 1

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            self.epochs[-1]["last"] = self.drawn()
            (self.out / "rank0.json").write_text(json.dumps(self.epochs))


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_two_ranks(tmp_path: Path, kind: str) -> None:
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    bar: Any = StepProgressBar() if kind == "tqdm" else RichStepProgressBar(console_kwargs={"file": io.StringIO()})
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
    # the epoch's counter and total, and the fit's steps: its total walked at the start with both ranks' samples
    assert [e["last"] for e in epochs] == [[7, 7, 7, 10], [3, 3, 10, 10]]
