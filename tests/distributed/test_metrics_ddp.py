"""The window's loss on 2 gloo ranks: token-weighted over both ranks' micro-batches, on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import Reference, TokenData, TokenModel, count_tokens, loader, rank_batches, trainer

pytestmark = pytest.mark.slow

SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")  # 8 batches of 4 per rank: short last windows


class Report(pl.Callback):
    monitor = "accum/grad_norm"  # (a monitor of the norm: it is measured every window, and read here)

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []  # type: ignore[var-annotated]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.callbacks[0].progress.step  # type: ignore[attr-defined]
        if step != len(self.rows):
            self.rows.append([float(trainer.callback_metrics[k]) for k in ("accum/loss", "accum/grad_norm")])

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def test_window_loss_over_ranks(tmp_path: Path) -> None:
    torch.set_default_dtype(torch.float64)  # Lightning logs in the default dtype (and the nets start from it)
    try:
        callbacks = [
            AccumulationScheduler(SCHEDULE, normalize="items", reduction="sum", count=count_tokens),
            Report(tmp_path),
        ]
        strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
        t = trainer(
            callbacks=callbacks, max_epochs=2, devices=2, strategy=strategy, use_distributed_sampler=False,
            log_every_n_steps=1,
        )  # fmt: skip
        t.fit(TokenModel(reduction="sum"), loader(TokenData(64), 4, sharded=True))
        reference = Reference(SCHEDULE, normalize="items")
        reference.run([rank_batches(TokenData(64), 4, world=2)] * 2)
    finally:
        torch.set_default_dtype(torch.float32)
    for rank in range(2):
        rows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(rows) == len(reference.losses)
        for (loss, norm), want_loss, want_norm in zip(rows, reference.losses, reference.grad_norms, strict=True):
            assert abs(loss - want_loss) <= 1e-12 and abs(norm - want_norm) <= 1e-12, (
                rows[:3],
                reference.losses[:3],
                reference.grad_norms[:3],
            )
