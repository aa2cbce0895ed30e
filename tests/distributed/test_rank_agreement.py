"""Ranks that disagree on k: a schedule reading rank-local state would make the ranks step at
different batches and hang in the next gradient collective (30 minutes by default, then a gloo
message that does not mention k). The package compares k at each window's start for schedules
that do not guarantee agreement, and fails there, on every rank, naming the schedule and the ks.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_accum import AccumulationScheduler, Lambda
from lightning_accum._core import collectives

from helpers import ManualTokenModel, TokenData, TokenModel, loader, trainer

pytestmark = pytest.mark.slow


def rank_local(progress: Any) -> int:
    return 2 + dist.get_rank()  # rank 0: k = 2, rank 1: k = 3


class Batches(pl.Callback):
    """Counts the batches; a rank that starts a second batch was not stopped at the first window: it fails there,
    at once, rather than leave the other rank waiting in a gradient collective until the process group's timeout."""

    def __init__(self) -> None:
        self.seen = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.seen += 1
        if self.seen > 1:
            raise AssertionError("The ranks went on past the first window: no rank refused their different k.")


def recording(out: Path, batches: Batches) -> Any:
    """``check_same_k`` that writes what it raised on each rank (each rank runs in a child process,
    where Lightning's launcher calls no ``on_exception``)."""
    check = collectives.check_same_k

    def wrapped(strategy: Any, k: int, schedule: object) -> None:
        try:
            check(strategy, k, schedule)
        except RuntimeError as error:
            (out / f"rank{dist.get_rank()}.txt").write_text(f"{batches.seen}|{error}")
            raise

    return wrapped


@pytest.mark.parametrize("where", ["callback", "mixin"])
def test_ranks_that_disagree_on_k_fail_at_the_first_window(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = Lambda(rank_local)
    batches = Batches()
    monkeypatch.setattr(collectives, "check_same_k", recording(tmp_path, batches))  # before the fork
    callbacks: list[pl.Callback] = [batches]
    if where == "callback":
        model: pl.LightningModule = TokenModel()
        callbacks.append(AccumulationScheduler(schedule))  # (after Batches, which counts the batch first)
    else:
        model = ManualTokenModel(schedule=schedule)
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo", timeout=datetime.timedelta(seconds=60))
    t = trainer(callbacks=callbacks, max_epochs=1, devices=2, strategy=strategy, use_distributed_sampler=False)
    # (a rank not stopped fails at its second batch, `Batches`; a hang would end in the process group's timeout error)
    with pytest.raises(Exception, match="disagree on the window's size"):
        t.fit(model, loader(TokenData(32), 4, sharded=True))
    for rank in range(2):
        batch, message = (tmp_path / f"rank{rank}.txt").read_text().split("|", 1)
        assert batch == "1"  # in the first batch, on every rank
        assert "Lambda(<function rank_local" in message and "k = [2, 3]" in message
