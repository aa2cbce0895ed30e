"""``estimated_stepping_batches`` on 2 gloo ranks: the schedule sees samples summed over ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy
from test_lr import Sized

from lightning_accum import AccumulationScheduler, Piecewise, Ramp

from helpers import TokenData, loader, trainer

pytestmark = pytest.mark.slow


class Report(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        report = {"total": pl_module.total, "steps": trainer.global_step, "onecycle": scheduler.last_epoch}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


# k from the samples of both ranks: 8 batches of 4, 4, ..., 3 per rank and epoch
@pytest.mark.parametrize("schedule", [Ramp(1, 4, over=150, unit="samples"), Piecewise({0: 3, 3: 2}, unit="step")])
def test_two_ranks(tmp_path: Path, schedule: Any) -> None:
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    callbacks = [AccumulationScheduler(schedule), Report(tmp_path)]
    t = trainer(callbacks=callbacks, max_epochs=3, devices=2, strategy=strategy, use_distributed_sampler=False)
    t.fit(Sized(), loader(TokenData(62), 4, sharded=True))  # 31 samples per rank: the last batch holds 3
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["total"] == report["steps"] == report["onecycle"]
