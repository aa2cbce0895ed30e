"""The window's end as its steps (``WindowEngine.close``): global counts -> gradient scale -> LR factor -> window
losses -> closing. Each rule a table; the steps checked against hand-computed windows."""

from __future__ import annotations

import math

import pytest

from lightning_accum._core.metrics import window_losses
from lightning_accum._core.window import lr_factor

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
