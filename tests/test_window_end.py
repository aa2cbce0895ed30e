"""The window's end as its steps (``WindowEngine.close``): global counts -> gradient scale -> LR factor -> window
losses -> closing. Each rule a table; the steps checked against hand-computed windows."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_accum import Constant
from lightning_accum._core.engine import Closing, WindowEngine
from lightning_accum._core.metrics import window_losses
from lightning_accum._core.window import lr_factor

from helpers import HostReads

# ------------------------------------------------------------------ the LR factor: (lr_scaling, unit, counts, first)
LR_FACTORS = [
    # lr_scaling, the budget's unit (None: a schedule of k), k, samples, items (over all ranks), first, factor
    (None, None, 8, 64, 64, 2, 1.0),  # no scaling
    (None, "items", 2, 8, 0, 6, 1.0),  # no scaling: a budget window's count does not matter
    ("linear", None, 8, 64, 64, 2, 4.0),  # k / first k
    ("sqrt", None, 8, 64, 64, 2, 2.0),
    ("linear", None, 1, 4, 4, 4, 0.25),  # smaller than the first window
    ("linear", None, 8, 64, 64, None, 1.0),  # no first window yet
    ("linear", None, 8, 64, 64, 0, 1.0),  # (a first size of 0 is no size)
    ("linear", "samples", 3, 24, 99, 12, 2.0),  # a budget of samples: the window's samples over the first budget
    ("linear", "items", 3, 24, 36, 12, 3.0),  # ... of items: its items, whatever its micro-batches and samples
    ("sqrt", "items", 3, 24, 48, 12, 2.0),
    ("linear", "items", 5, 40, 9, 12, 0.75),  # closed by `max_k` before its budget
    # the zero-count window (issue 53): a budget window that took no item (closed by `max_k` or the epoch's end) steps
    # under normalize="mean" with factor 0, as the guide's formula gives (its count over the first window's n)
    ("linear", "items", 2, 8, 0, 6, 0.0),
    ("sqrt", "items", 2, 8, 0, 6, 0.0),
    ("linear", "samples", 2, 0, 0, 6, 0.0),
]


@pytest.mark.parametrize(("scaling", "unit", "k", "samples", "items", "first", "factor"), LR_FACTORS)
def test_lr_factor_table(
    scaling: str | None, unit: str | None, k: int, samples: int, items: int, first: int | None, factor: float
) -> None:
    assert lr_factor(scaling, unit, k, samples, items, first) == factor


def test_lr_factor_is_exactly_the_ratio_or_its_root() -> None:
    assert lr_factor("linear", None, 7, 0, 0, 3) == 7 / 3
    assert lr_factor("sqrt", "samples", 1, 7, 0, 3) == math.sqrt(7 / 3)


# ---------------------------------------------------------------------- the window's losses: (sums, global count)
WINDOW_LOSSES = [
    # the losses' sums over all ranks, by name; the window's global count (micro-batches, or items); its losses
    ({"loss": 6.0}, 3, {"loss": 2.0}),
    ({"loss": 6.0, "task": 1.5}, 3, {"loss": 2.0, "task": 0.5}),  # each task over the same count as the window
    ({"loss": 1.0}, 3, {"loss": 1 / 3}),  # (one division: exactly the float of the ratio)
    ({"loss": -2.0}, 4, {"loss": -0.5}),
    ({}, 4, {}),  # read, but no loss went in (a `training_step` that logged none): no name, not "no read"
    ({"loss": 0.0}, 0, None),  # a window of count 0: no loss (it is not stepped under "items"; nothing under "mean")
    ({}, 0, None),
]


@pytest.mark.parametrize(("sums", "count", "losses"), WINDOW_LOSSES)
def test_window_losses_table(sums: dict[str, float], count: int, losses: dict[str, float] | None) -> None:
    assert window_losses(sums, count) == losses


# ---------------------------------------------------------------------- global counts: one record, whatever the world
class Twin:
    """Two ranks, the other closing the same window with the same numbers: every sum over ranks is twice this rank's,
    in one reduce (counted)."""

    world_size = 2
    root_device = torch.device("cpu")

    def __init__(self) -> None:
        self.reduces = 0

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        self.reduces += 1
        return tensor * 2


def closed(normalize: str, tensor_counts: bool, strategy: Any, read: bool = True) -> tuple[Closing, int]:
    """A window of 3 micro-batches (4 samples; 2, 3 and 4 items, as ints or tensors; losses 1, 2.5 and 4) closed
    under ``strategy`` with its gradient's norm and two extra integers; and the host reads the close made."""
    engine = WindowEngine(Constant(3), normalize=normalize, lr_scaling="linear", reduction="sum")
    engine.metrics.tracking = True
    engine.open(epoch=0, start=0)
    for items, loss in ((2, 1.0), (3, 2.5), (4, 4.0)):
        engine.count(4, torch.tensor(items) if tensor_counts else items)
        engine.metrics.add_loss(torch.tensor(loss, dtype=torch.float64))
        engine.backward_done()
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # (norms 5 and 12: the gradient's is 13)
    with HostReads() as reads:
        closing = engine.close(strategy, extra=[1, 0], grads=grads, losses=read, norm=read)
    return closing, reads.count


@pytest.mark.parametrize("tensor_counts", [False, True], ids=["host counts", "tensor counts"])
@pytest.mark.parametrize("normalize", ["mean", "items"])
def test_one_device_and_several_ranks_differ_only_in_how_the_counts_are_summed(
    normalize: str, tensor_counts: bool
) -> None:
    one, one_reads = closed(normalize, tensor_counts, None)
    twin = Twin()
    two, two_reads = closed(normalize, tensor_counts, twin)
    assert (one.microbatches, one.samples, one.items, one.extra) == (3, 12, 9, (1, 0))
    assert (two.microbatches, two.samples, two.items, two.extra) == (6, 24, 18, (2, 0))
    assert twin.reduces == 1 and one_reads == two_reads == 1  # one collective (none on one device), one host read
    over = 3 if normalize == "mean" else 9
    assert one.scale == two.scale == (1.0 if normalize == "mean" else 3 / 9)  # each loss was divided by k = 3
    assert one.losses == two.losses == {"loss": 7.5 / over}
    assert one.norm_sq == two.norm_sq == 169 * one.scale**2
    assert one.lr_factor == two.lr_factor == 1.0 and not one.empty and not two.empty


@pytest.mark.parametrize("tensor_counts", [False, True], ids=["host counts", "tensor counts"])
def test_nothing_read_reads_nothing_but_tensor_counts(tensor_counts: bool) -> None:
    one, reads = closed("items", tensor_counts, None, read=False)
    assert one.losses is None and one.norm_sq is None and one.items == 9
    assert reads == (1 if tensor_counts else 0)
