"""``_trainer/fit_checks.py``'s rules as table tests, with a stand-in trainer whose ranks' loader lengths are given
(the 2-rank fits are in ``tests/distributed/test_budget_ddp.py``)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_accum import Budget, Constant
from lightning_accum._trainer.fit_checks import refuse_uneven_budget_data


def _trainer(ranks: list[float]) -> Any:
    """Rank 0 of ``len(ranks)``, whose loaders hold ``ranks`` batches (``inf``: no length); ``gathers`` counts the
    all-gathers."""

    def all_gather(mine: torch.Tensor) -> torch.Tensor:
        trainer.gathers += 1
        assert mine.tolist() == [-1 if math.isinf(ranks[0]) else int(ranks[0])]
        return torch.tensor([[-1 if math.isinf(n) else int(n)] for n in ranks])

    strategy = SimpleNamespace(world_size=len(ranks), root_device=torch.device("cpu"), all_gather=all_gather)
    trainer = SimpleNamespace(strategy=strategy, num_training_batches=ranks[0], gathers=0)
    return trainer


BUDGET = Budget(16, unit="samples")


@pytest.mark.parametrize(
    ("schedule", "ranks", "gathers"),
    [
        (BUDGET, [5, 5], 1),
        (BUDGET, [4, 4, 4, 4], 1),
        (BUDGET, [math.inf, math.inf], 1),  # (loaders without a length: not checked)
        (BUDGET, [5, math.inf], 1),
        (BUDGET, [math.inf, 3], 1),
        (BUDGET, [5], 0),  # (one process)
        (Constant(2), [5, 4], 0),  # (not a budget: no count summed over the ranks at each micro-batch)
    ],
)
def test_ranks_are_not_refused_where_their_lengths_agree_or_are_unknown(
    schedule: Any, ranks: list, gathers: int
) -> None:
    trainer = _trainer(ranks)
    refuse_uneven_budget_data(trainer, schedule, "AccumulationScheduler")
    assert trainer.gathers == gathers


@pytest.mark.parametrize(
    ("ranks", "named", "limit"),
    [
        ([5, 4], "[5, 4] batches (ranks 0..1)", 4),
        ([4, 5], "[4, 5] batches (ranks 0..1)", 4),
        ([3, 3, 2], "[3, 3, 2] batches (ranks 0..2)", 2),
        ([0, 3], "[0, 3] batches (ranks 0..1)", 0),  # (a rank with no batch at all: the other would wait in the count)
    ],
)
def test_ranks_whose_loaders_differ_are_refused_naming_the_lengths_and_the_fix(
    ranks: list[int], named: str, limit: int
) -> None:
    with pytest.raises(RuntimeError) as refused:
        refuse_uneven_budget_data(_trainer(ranks), BUDGET, "configure_accumulation")
    message = str(refused.value)
    assert message.startswith("`configure_accumulation(Budget(16, unit='samples'))` needs every rank to run the same")
    assert f"training loaders hold {named}:" in message and message.endswith(f"`Trainer(limit_train_batches={limit})`.")
