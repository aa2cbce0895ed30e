"""``_trainer/steps.py`` piece by piece: the walk of a fit's windows, ``estimated_stepping_batches`` on a stand-in
Trainer, the loader's samples per batch, the refusals and the horizon warning, each against an independent
reference (a plain batch-by-batch loop over the fit, or counts worked out by hand). Host arithmetic, no fit."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import AccumulationScheduler, Budget, Constant, Lambda, Piecewise, Ramp, SchedulerHorizonWarning
from lightning_accum._trainer import steps
from lightning_accum.noise import NoiseScale
from lightning_accum.schedules import Progress, Schedule

SIZES = [2] * 16 + [1]  # 33 samples in batches of 2: 17 batches, the last of 1


def reference(
    schedule: Schedule, batches: int, sizes: list[int] | None, max_epochs: int, max_steps: int
) -> tuple[int, list[Progress]]:
    """The fit's optimizer steps, one batch at a time: a window opens at a batch when none is open (its k, or a
    ``Budget``'s n and cap, asked then), takes the batch, and closes at its k-th batch, when its samples reach n,
    or at the epoch's last batch; the fit stops at ``max_steps`` steps. Also the ``Progress`` after each window."""
    step = samples = micro = 0
    after: list[Progress] = []
    epoch = 0
    while max_epochs == -1 or epoch < max(max_epochs, 1):
        open_ = False
        for b in range(batches):
            if not open_:
                asked = Progress(epoch=epoch, step=step, samples=samples, items=samples, microbatches=micro)
                cap = schedule(asked)
                n = schedule.budget(asked) if isinstance(schedule, Budget) else None
                open_, taken, seen = True, 0, 0
            taken += 1
            seen += 0 if sizes is None else sizes[b]
            if taken == cap or b == batches - 1 or (n is not None and seen >= n):
                step, samples, micro, open_ = step + 1, samples + seen, micro + taken, False
                after.append(Progress(epoch=epoch, step=step, samples=samples, items=samples, microbatches=micro))
                if step == max_steps:
                    return step, after
        epoch += 1
    return step, after


SCHEDULES = [
    Constant(1), Constant(3), Constant(17), Constant(40),
    Piecewise({0: 2, 2: 5}, unit="epoch"), Piecewise({1: 3}, unit="epoch"), Ramp(1, 4, over=3, unit="epoch"),
    Ramp(1, 5, over=40, unit="step"), Piecewise({0: 1, 3: 4, 7: 2}, unit="step"),
    Ramp(1, 5, over=60, unit="samples"), Piecewise({0: 2, 9: 3, 30: 16}, unit="samples"),
    Lambda(lambda p: 1 + (p.microbatches % 3)), Lambda(lambda p: 1 + p.items % 4),
    Budget(5, unit="samples"), Budget(4, unit="samples", max_k=3),
    Budget(Ramp(1, 9, over=30, unit="samples"), "samples"),
]  # fmt: skip
FITS = [(1, -1), (2, -1), (3, -1), (0, -1), (3, 1), (3, 7), (3, 9), (3, 10), (2, 1000), (-1, 23), (-1, 1)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_the_walk_is_the_batch_by_batch_fit(schedule: Schedule) -> None:
    """``_walk`` and ``fit_windows`` (where ``walk_is_exact``) give the reference's steps for every fit length, and
    ``windows`` the reference's ``Progress`` after each window of the first epoch."""
    for max_epochs, max_steps in FITS:
        want, _ = reference(schedule, 17, SIZES, max_epochs, max_steps)
        assert steps._walk(schedule, 17, SIZES, max_epochs, max_steps) == want, (max_epochs, max_steps)
        if steps.walk_is_exact(schedule, SIZES):
            assert steps.fit_windows(schedule, 17, SIZES, max_epochs, max_steps) == want, (max_epochs, max_steps)
    _, after = reference(schedule, 17, SIZES, 1, -1)
    assert [p for _, p in steps.windows(schedule, Progress(), 0, 17, SIZES)] == after


def test_an_epochs_windows_carry_what_the_walk_does_not_change() -> None:
    """``windows`` from the middle of an epoch: the epoch and ``scaled_steps`` are carried, the items grow with the
    samples (their difference kept), the last window is cut at the epoch's end, the schedule asked at each start."""
    asked: list[Progress] = []

    def k(p: Progress) -> int:
        asked.append(p)
        return 3

    start = Progress(epoch=3, step=5, samples=10, items=25, microbatches=7, scaled_steps=2.5)
    got = list(steps.windows(Lambda(k), start, 2, 10, [2] * 9 + [1]))
    assert got == [
        (3, Progress(3, 6, 16, 31, 10, 2.5)),
        (3, Progress(3, 7, 22, 37, 13, 2.5)),
        (2, Progress(3, 8, 25, 40, 15, 2.5)),  # (batches 8 and 9: 2 + 1 samples)
    ]
    assert asked == [start, Progress(3, 6, 16, 31, 10, 2.5), Progress(3, 7, 22, 37, 13, 2.5)]
    assert list(steps.windows(Constant(4), Progress(step=1, samples=8, items=8), 0, 6, None)) == [
        (4, Progress(0, 2, 8, 8, 4)), (2, Progress(0, 3, 8, 8, 6))]  # fmt: skip  # (no sizes: samples not counted)
    assert list(steps.windows(Constant(4), Progress(), 6, 6, SIZES)) == []  # (from the epoch's end: none)
    assert list(steps.windows(Constant(4), Progress(), 5, 6, SIZES)) == [(1, Progress(0, 1, 2, 2, 1))]


def test_windows_of_an_endless_loader_go_on() -> None:
    """``batches`` inf (an iterable loader): windows of k, without end."""
    walk = steps.windows(Constant(3), Progress(), 0, math.inf, None)
    assert [next(walk)[0] for _ in range(5)] == [3] * 5


def test_a_walk_without_the_items_refuses_a_schedule_that_reads_them() -> None:
    """``items_known=False`` (a ``count`` gives them): reading ``items`` raises ``ItemsNotKnown``; the other counters
    are read as they are."""
    reads_items = Lambda(lambda p: 1 + p.items % 2)
    with pytest.raises(steps.ItemsNotKnown):
        list(steps.windows(reads_items, Progress(), 0, 4, [1] * 4, items_known=False))
    with pytest.raises(steps.ItemsNotKnown):
        steps._walk(reads_items, 4, [1] * 4, 1, -1, items_known=False)
    with pytest.raises(steps.ItemsNotKnown):
        steps.windows_ahead(reads_items, Progress(), 0, 4, [1] * 4, 9, items_known=False)
    reads_others = Lambda(lambda p: 1 + (p.samples + p.step + p.epoch + p.microbatches) % 2)
    got = [m for m, _ in steps.windows(reads_others, Progress(epoch=1), 0, 8, [1] * 8, items_known=False)]
    assert got == [2, 1, 2, 1, 2]  # (samples + step + 1 + microbatches: 1, 6, 9, 14, 17 at the starts)
    assert [m for m, _ in steps.windows(reads_items, Progress(), 0, 4, [1] * 4)] == [1, 2, 1]  # (known: 0, 1, 3)
    unknown = steps._ItemsUnknown(1, 2, 3, 4, 5, 6.0)
    assert (unknown.epoch, unknown.step, unknown.samples, unknown.microbatches) == (1, 2, 3, 5)
    assert repr(unknown) == "Progress(epoch=1, step=2, samples=3, items=?, ...)"


@pytest.mark.parametrize(
    "budget, cap, start, batches, want",
    [(5, 99, 0, 6, 3), (4, 99, 0, 6, 2), (1, 99, 0, 6, 1), (2, 99, 0, 6, 1), (3, 99, 0, 6, 2), (99, 99, 0, 6, 6),
     (99, 2, 0, 6, 2), (99, 1, 0, 6, 1), (5, 2, 0, 6, 2), (99, 99, 4, 6, 2), (99, 99, 5, 6, 1), (99, 99, 6, 6, 0),
     (6, 99, 3, 6, 2), (7, 99, 3, 6, 3), (8, 99, 3, 6, 3), (5, 99, 3, 6, 1), (2, 99, 1, math.inf, 1),
     (3, 99, 1, math.inf, 2), (7, 99, 0, math.inf, 3)],
)  # fmt: skip
def test_a_budgets_window(budget: int, cap: int, start: int, batches: float, want: int) -> None:
    """Up to the first batch at which the samples reach the budget, at most ``cap``, or to the epoch's end."""
    sizes = [2, 2, 3, 5, 1, 1]  # (from batch 0: 2, 4, 7, 12, 13, 14 samples; from 3: 5, 6, 7)
    assert steps._budget_window(budget, cap, start, batches, sizes) == want
    with pytest.raises(ValueError, match="sizes"):
        steps._budget_window(budget, cap, start, batches, None)


def test_a_budget_is_asked_its_n_where_each_window_opens() -> None:
    budget = Budget(lambda p: 3 if p.step % 2 else 6, unit="samples", max_k=4)
    got = [(m, p.samples) for m, p in steps.windows(budget, Progress(), 0, 12, [1, 2] * 6)]
    assert got == [(4, 6), (2, 9), (4, 15), (2, 18)]  # (n 6: 1+2+1+2; n 3: 1+2; n 6; n 3)


@pytest.mark.parametrize(
    "limit, want",
    [(0, (0, 0)), (-1, (0, 0)), (-math.inf, (0, 0)), (1, (1, 3)), (2, (2, 6)), (3, (3, 9)), (6, (6, 17)),
     (7, (6, 17)), (math.inf, (6, 17)), (2.5, (3, 9))],
)  # fmt: skip
def test_windows_ahead_counts_at_most_limit_windows(limit: float, want: tuple[int, int]) -> None:
    """Windows of 3 over 17 batches: 3, 3, 3, 3, 3, 2; at most ``limit`` of them (the steps ``max_steps`` leaves)."""
    assert steps.windows_ahead(Constant(3), Progress(), 0, 17, None, limit) == want
    assert steps.windows_ahead(Constant(3), Progress(), 15, 17, None, limit) == ((1, 2) if limit >= 1 else (0, 0))


@pytest.mark.parametrize(
    "schedule, sized, unsized",
    [(Constant(2), True, True), (Piecewise({0: 2}, unit="epoch"), True, True),
     (Ramp(1, 4, over=9, unit="step"), True, True), (Ramp(1, 4, over=9, unit="samples"), True, False),
     (Piecewise({0: 2}, unit="items"), False, False), (Piecewise({0: 2}, unit="scaled_steps"), False, False),
     (Lambda(lambda p: 2), False, False), (Lambda(lambda p: 2, unit="step"), True, True),
     (Lambda(lambda p: 2, unit="samples"), True, False), (NoiseScale(2, 8), False, False),
     (Budget(8, unit="samples"), True, False), (Budget(Ramp(1, 9, over=5, unit="step"), "samples"), True, False),
     (Budget(Ramp(1, 9, over=5, unit="items"), "samples"), False, False), (Budget(8, unit="items"), False, False)],
)  # fmt: skip
def test_walk_is_exact(schedule: Schedule, sized: bool, unsized: bool) -> None:
    """Exact where the walk knows what the schedule reads: not items, ``Lambda`` (any counter), ``NoiseScale``; samples
    only with each batch's size (an empty list says none)."""
    assert steps.walk_is_exact(schedule, [2, 2]) is sized
    assert steps.walk_is_exact(schedule, None) is unsized
    assert steps.walk_is_exact(schedule, []) is unsized


@pytest.mark.parametrize(
    "schedule, batches, max_epochs, max_steps, want",
    [(Constant(3), 17, 2, -1, 12), (Constant(3), 17, 0, -1, 6), (Constant(3), 17, 2, 5, 5),
     (Constant(3), 17, 2, 12, 12), (Constant(3), 17, 2, 13, 12), (Constant(3), 17, -1, 5, 5),
     (Constant(3), 0, 2, -1, 0), (Constant(3), 17, 2, 0, 0), (Constant(1), 1, 1, -1, 1), (Constant(20), 17, 3, -1, 3),
     (Constant(17), 17, 3, -1, 3), (Constant(16), 17, 3, -1, 6),
     (Piecewise({1: 4}, unit="epoch"), 17, 3, -1, 17 + 5 + 5), (Piecewise({1: 4}, unit="epoch"), 17, 0, -1, 17),
     (Piecewise({1: 4}, unit="epoch"), 17, 3, 20, 20), (Piecewise({1: 4}, unit="epoch"), 17, -1, 20, 20),
     (Piecewise({1: 4}, unit="epoch"), 17, 3, 22, 22), (Piecewise({1: 4}, unit="epoch"), 17, 3, 27, 27),
     (Piecewise({1: 4}, unit="epoch"), 17, 3, 30, 27), (Piecewise({1: 4}, unit="epoch"), 0, 3, -1, 0),
     (Piecewise({1: 4}, unit="epoch"), 17, 3, 0, 0), (Ramp(1, 5, over=4, unit="step"), 9, 2, -1, 4 + 2),
     (Ramp(1, 5, over=4, unit="step"), 0, 2, -1, 0), (Ramp(1, 5, over=4, unit="step"), 9, 2, 0, 0),
     (Ramp(1, 5, over=4, unit="step"), 9, -1, 3, 3)],
)  # fmt: skip
def test_fit_windows_by_hand(schedule: Schedule, batches: int, max_epochs: int, max_steps: int, want: int) -> None:
    """Counted by hand: ``ceil(batches / k)`` windows an epoch; ``max_epochs=0`` is one epoch (as Lightning's
    estimate); at most ``max_steps``; nothing for no batches or ``max_steps=0``. (The step ramp over 9 batches: k 1, 2,
    3, 4 then 5: windows of 1, 2, 3, 3 cut, then 5, 4 cut.)"""
    assert steps.fit_windows(schedule, batches, None, max_epochs, max_steps) == want


def test_a_walk_stops_at_its_budget_of_windows() -> None:
    """``_walk_within``: ``None`` once ``budget`` windows are formed without the fit's end (``max_steps`` reached at
    that window is the end); the whole fit within it counted."""
    ramp = Ramp(1, 5, over=4, unit="step")  # 6 windows over 2 epochs of 9 batches
    assert steps._walk_within(ramp, 9, None, 2, -1, 7) == 6
    assert steps._walk_within(ramp, 9, None, 2, -1, 6) is None  # (it walks at most 6 windows: the 6th ends the budget)
    assert steps._walk_within(ramp, 9, None, 2, -1, 5) is None
    assert steps._walk_within(ramp, 9, None, 2, 5, 5) == 5
    assert steps._walk_within(ramp, 9, None, 2, 4, 5) == 4
    assert steps._walk_within(ramp, 9, None, -1, 40, 30) is None
    assert steps._walk_within(ramp, 9, None, -1, 30, 30) == 30
    assert steps._walk(ramp, 9, None, -1, 30) == 30


@pytest.mark.parametrize(
    "steps_, max_steps, optimizers, want",
    [(10, 5, 1, 10), (10, -1, 2, 10), (10, -1, 3, 10), (10, 5, 2, 3), (10, 6, 2, 3), (10, 7, 3, 3), (10, 9, 3, 3),
     (2, 7, 3, 2), (3, 7, 3, 3), (10, 0, 2, 0), (10, 1, 2, 1), (math.inf, 7, 2, 4), (math.inf, -1, 2, math.inf)],
)  # fmt: skip
def test_per_optimizer(steps_: float, max_steps: int, optimizers: int, want: float) -> None:
    """``max_steps`` counts each optimizer's steps: ``ceil(max_steps / optimizers)`` windows at most."""
    assert steps._per_optimizer(steps_, max_steps, optimizers) == want


@pytest.mark.parametrize(
    "optimizers, error",
    [(True, TypeError), (False, TypeError), (1.0, TypeError), (2.5, TypeError), ("2", TypeError), (None, TypeError),
     (math.nan, TypeError), (0, ValueError), (-1, ValueError), (-(2**40), ValueError)],
)  # fmt: skip
def test_optimizers_refused(optimizers: Any, error: type) -> None:
    with pytest.raises(error, match=r"optimizers=\.\.\.\).*integer >= 1.*got"):
        steps._check_optimizers(optimizers)


def test_optimizers_is_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        steps.estimated_stepping_batches(stand_in(Constant(3)), 2)  # type: ignore[misc]
    assert steps.estimated_stepping_batches(stand_in(Constant(3), max_steps=7), optimizers=2) == 4


def test_optimizers_taken() -> None:
    import numpy as np

    assert [steps._check_optimizers(n) for n in (1, 2, 7, np.int64(3))] == [1, 2, 7, 3]
    assert type(steps._check_optimizers(np.int64(3))) is int


# -- estimated_stepping_batches on a stand-in Trainer ---------------------------------------------------------------


def callback(schedule: Schedule, count: Callable[..., int] | None = None) -> Any:
    return SimpleNamespace(schedule=schedule, count=count, normalize="mean", progress=Progress())


def stand_in(schedule: Schedule | None = None, **fields: Any) -> Any:
    """A Trainer as ``steps`` reads it: 17 batches of 2 (the last of 1) an epoch, 2 epochs, one rank, the training
    loader already set up (``_seam.set_up_training_loader`` leaves it)."""
    base: dict[str, Any] = dict(
        lightning_module=object(), max_steps=-1, max_epochs=2, limit_train_batches=1.0, num_training_batches=17,
        callbacks=[] if schedule is None else [callback(schedule)],
        train_dataloader=DataLoader(range(33), batch_size=2),
        world_size=1, fit_loop=SimpleNamespace(_combined_loader=object()), ckpt_path=None, lr_scheduler_configs=[],
        estimated_stepping_batches=1234.0,
    )  # fmt: skip
    base.update(fields)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "fields, want",
    [({}, 12), ({"max_epochs": 1}, 6), ({"max_epochs": 0}, 6), ({"max_epochs": 3}, 18), ({"max_steps": 5}, 5),
     ({"max_steps": 12}, 12), ({"max_steps": 13}, 12), ({"max_epochs": -1, "max_steps": 5}, 5),
     ({"max_epochs": -1, "max_steps": 100}, 100), ({"max_steps": 0}, 0), ({"limit_train_batches": 0}, 0),
     ({"limit_train_batches": 0.0}, 0), ({"num_training_batches": 4}, 4), ({"num_training_batches": 3.0}, 2),
     ({"max_epochs": -1, "max_steps": -1}, math.inf),
     ({"max_epochs": -1, "max_steps": -1, "limit_train_batches": 0}, 0),
     ({"num_training_batches": math.inf, "max_steps": 9}, 9),
     ({"num_training_batches": math.inf, "max_steps": 9, "max_epochs": -1}, 9),
     ({"train_dataloader": None}, 12), ({"world_size": 4}, 12)],
)  # fmt: skip
def test_estimate_of_a_constant(fields: dict[str, Any], want: float) -> None:
    """``Constant(3)`` over 17 batches: 6 windows an epoch (a loader that does not say its batch sizes is not
    needed for it)."""
    got = steps.estimated_stepping_batches(stand_in(Constant(3), **fields))
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "schedule",
    [Ramp(1, 5, over=60, unit="samples"), Piecewise({0: 2, 9: 3, 30: 16}, unit="samples"), Budget(5, unit="samples"),
     Budget(4, unit="samples", max_k=3), Ramp(1, 5, over=20, unit="step"), Piecewise({1: 4}, unit="epoch"),
     Lambda(lambda p: 1 + p.samples % 5), Lambda(lambda p: 1 + p.items % 4)],
    ids=repr,
)  # fmt: skip
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_estimate_is_the_batch_by_batch_fit(schedule: Schedule, world: int, drop_last: bool) -> None:
    """The samples of each batch over all ranks from the loader (``drop_last``: 16 batches of 2; two ranks: twice
    the samples), the fit walked: the reference's steps."""
    loader = DataLoader(range(33), batch_size=2, drop_last=drop_last)
    batches = 16 if drop_last else 17
    sizes = [2 * world] * 16 + ([] if drop_last else [world])
    for max_epochs, max_steps in [(2, -1), (3, 9), (-1, 30)]:
        t = stand_in(schedule, train_dataloader=loader, num_training_batches=batches, world_size=world,
                     max_epochs=max_epochs, max_steps=max_steps)  # fmt: skip
        want, _ = reference(schedule, batches, sizes, max_epochs, max_steps)
        assert steps.estimated_stepping_batches(t) == want
        each = min(want, -(-max_steps // 2)) if max_steps > 0 else want  # (max_steps: 2 steps a window)
        assert steps.estimated_stepping_batches(t, optimizers=2) == each


def test_estimate_with_a_limit_of_batches() -> None:
    """``limit_train_batches`` (``num_training_batches`` 5): the first 5 batches' samples; a ramp over 6 samples
    gives k 1, 1, 2, 3, 4: windows of 1, 1, 2, 1 cut, then of 4, 1 cut."""
    t = stand_in(Ramp(1, 4, over=8, unit="samples"), num_training_batches=5, limit_train_batches=5)
    assert steps.estimated_stepping_batches(t) == want_of(Ramp(1, 4, over=8, unit="samples"), 5, [2] * 5, 2, -1)


def want_of(schedule: Schedule, batches: int, sizes: list[int], max_epochs: int, max_steps: int) -> int:
    return reference(schedule, batches, sizes, max_epochs, max_steps)[0]


def test_estimate_without_a_schedule_is_lightnings() -> None:
    """No ``AccumulationScheduler`` and no mixin: Lightning's estimate, an int (or inf)."""
    assert steps.estimated_stepping_batches(stand_in(estimated_stepping_batches=7.0)) == 7
    assert type(steps.estimated_stepping_batches(stand_in(estimated_stepping_batches=7.0))) is int
    assert steps.estimated_stepping_batches(stand_in(estimated_stepping_batches=math.inf)) == math.inf
    assert steps.estimated_stepping_batches(stand_in(estimated_stepping_batches=9.0, max_steps=7), optimizers=2) == 4
    assert steps.estimated_stepping_batches(stand_in(estimated_stepping_batches=9.0, max_steps=0)) == 0


def test_estimate_sets_up_the_loader_and_releases_it() -> None:
    """The training loader set up for the count (``fit_loop.setup_data``), dropped again where a checkpoint is to be
    restored (so that it is set up afresh after it)."""
    for schedule in (None, Constant(3)):
        for ckpt_path, kept in ((None, True), ("last.ckpt", False)):
            calls: list[int] = []
            loop = SimpleNamespace(_combined_loader=None)
            loop.setup_data = lambda loop=loop, calls=calls: (calls.append(1), setattr(loop, "_combined_loader", "set"))
            t = stand_in(schedule, fit_loop=loop, ckpt_path=ckpt_path, estimated_stepping_batches=12.0)
            assert steps.estimated_stepping_batches(t) == 12
            assert calls == [1] and (loop._combined_loader == "set") is kept


def test_estimate_refusals() -> None:
    with pytest.raises(RuntimeError, match="before a fit"):
        steps.estimated_stepping_batches(stand_in(Constant(3), lightning_module=None))
    with pytest.raises(RuntimeError, match="before a fit"):
        steps.estimated_stepping_batches(SimpleNamespace(max_steps=-1))
    with pytest.raises(ValueError, match="no length"):
        steps.estimated_stepping_batches(stand_in(Constant(3), num_training_batches=math.inf))
    for schedule in (Ramp(1, 4, over=9, unit="samples"), Lambda(lambda p: 2), Budget(4, unit="samples")):
        with pytest.raises(ValueError, match="does not say how many each batch holds"):
            steps.estimated_stepping_batches(stand_in(schedule, train_dataloader=None))
    # (k 1, 1, 1, 2, 2, 2, 3, 3, 2 cut: 9 windows; then 4, 4, 4, 4, 1 cut)
    assert steps.estimated_stepping_batches(stand_in(Ramp(1, 4, over=9, unit="step"), train_dataloader=None)) == 14
    with pytest.raises(TypeError, match="optimizers"):
        steps.estimated_stepping_batches(stand_in(Constant(3)), optimizers=0.5)  # type: ignore[arg-type]


def test_estimate_with_a_count_refuses_a_function_of_the_items() -> None:
    reads_items = Lambda(lambda p: 1 + p.items % 4)
    t = stand_in(callbacks=[callback(reads_items, count=len)])
    with pytest.raises(ValueError, match=r"reads `Progress\.items`"):
        steps.estimated_stepping_batches(t)
    t = stand_in(callbacks=[callback(Ramp(1, 4, over=20, unit="samples"), count=len)])
    assert steps.estimated_stepping_batches(t) == want_of(Ramp(1, 4, over=20, unit="samples"), 17, SIZES, 2, -1)


@pytest.mark.parametrize(
    "schedule, says",
    [(Budget(5, unit="items"), "hold, so"),
     (Budget(Ramp(1, 9, over=5, unit="items"), "samples"), "its `n` follows them"),
     (Piecewise({0: 2}, unit="items"), r"the items \(tokens\) the data will hold"),
     (Piecewise({0: 2}, unit="scaled_steps"), "measured gradient noise"),
     (NoiseScale(2, 8), "measured gradient noise")],
)  # fmt: skip
def test_steps_not_known_in_advance_are_refused(schedule: Schedule, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        steps._refuse_unknown_steps(schedule)
    with pytest.raises(ValueError, match="cannot be known in advance"):
        steps.estimated_stepping_batches(stand_in(schedule))
    with pytest.raises(ValueError, match="cannot be known in advance"):  # (an endless fit too)
        steps.estimated_stepping_batches(stand_in(schedule, max_epochs=-1))


def test_steps_known_in_advance_are_not_refused() -> None:
    for schedule in (Budget(5, unit="samples"), Budget(Ramp(1, 9, over=5, unit="step"), "samples"), Constant(2),
                     Piecewise({0: 2}, unit="samples"), Lambda(lambda p: 2)):  # fmt: skip
        steps._refuse_unknown_steps(schedule)


def test_samples_per_batch() -> None:
    """From the loader's batch sampler: its batch size, the sampler's length, ``drop_last``, times the ranks, the
    epoch's first ``batches``."""
    t = stand_in()
    assert steps.samples_per_batch(t, 17) == SIZES
    assert steps.samples_per_batch(t, 3) == [2, 2, 2]
    assert steps.samples_per_batch(t, 40) == SIZES
    assert steps.samples_per_batch(stand_in(world_size=3), 17) == [6] * 16 + [3]
    assert steps.samples_per_batch(stand_in(train_dataloader=DataLoader(range(32), batch_size=4)), 9) == [4] * 8
    assert steps.samples_per_batch(stand_in(train_dataloader=DataLoader(range(35), batch_size=4)), 9) == [4] * 8 + [3]
    loader = DataLoader(range(35), batch_size=4, drop_last=True)
    assert steps.samples_per_batch(stand_in(train_dataloader=loader), 9) == [4] * 8
    assert steps.samples_per_batch(stand_in(train_dataloader=DataLoader(range(3), batch_size=4)), 1) == [3]


class Endless(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


@pytest.mark.parametrize(
    "loader",
    [None, DataLoader(range(8), batch_size=None), DataLoader(Endless(), batch_size=2),
     SimpleNamespace(batch_sampler=SimpleNamespace(batch_size=2, sampler=None)),
     SimpleNamespace(batch_sampler=SimpleNamespace(batch_size=None, sampler=range(8))),
     SimpleNamespace(batch_sampler=SimpleNamespace(batch_size=2, sampler=iter(range(8))))],
    ids=["none", "no batch size", "iterable", "no sampler", "sampler, no size", "sampler without length"],
)  # fmt: skip
def test_samples_per_batch_not_said(loader: Any) -> None:
    """A loader that does not say each batch's samples: ``None``, or refused where the schedule counts samples."""
    assert steps.samples_per_batch(stand_in(train_dataloader=loader), 4) is None
    assert steps._samples_per_batch(stand_in(train_dataloader=loader), 4, needed=False) is None
    with pytest.raises(ValueError, match="does not say how many each batch holds"):
        steps._samples_per_batch(stand_in(train_dataloader=loader), 4, needed=True)
    said = SimpleNamespace(batch_sampler=SimpleNamespace(batch_size=2, sampler=range(8)))
    assert steps._samples_per_batch(stand_in(train_dataloader=said), 4, True) == [2] * 4


def test_accumulating_reads_the_callback_or_the_mixin() -> None:
    """The callback first (with a ``schedule`` and a ``count``), else the module's mixin; its ``Progress`` read live."""
    cb = callback(Constant(3), count=len)
    found = steps.accumulating(stand_in(callbacks=[object(), SimpleNamespace(schedule=Constant(9)), cb]))
    assert found is not None and (found.schedule, found.counted, found.normalize) == (Constant(3), True, "mean")
    cb.progress = Progress(step=4)
    assert found.progress() == Progress(step=4)
    not_one = SimpleNamespace(schedule="not one", count=None)
    found = steps.accumulating(stand_in(callbacks=[not_one, callback(Constant(2))]))
    assert found is not None and (found.schedule, found.counted) == (Constant(2), False)
    config = SimpleNamespace(schedule=Constant(5), count=None, normalize="items")
    module = SimpleNamespace(_accumulation=SimpleNamespace(config=config), accumulation_progress=Progress(step=1))
    found = steps.accumulating(stand_in(lightning_module=module))
    assert found is not None and (found.schedule, found.counted, found.normalize) == (Constant(5), False, "items")
    module.accumulation_progress = Progress(step=2)
    assert found.progress() == Progress(step=2)
    config.count = len
    found = steps.accumulating(stand_in(lightning_module=module, callbacks=[callback(Constant(7))]))
    assert found is not None and found.schedule == Constant(7)  # (the callback's first)
    found = steps.accumulating(stand_in(lightning_module=module))
    assert found is not None and found.counted
    assert steps.accumulating(stand_in()) is None
    assert steps.accumulating(stand_in(lightning_module=None)) is None
    assert steps.accumulating(stand_in(lightning_module=SimpleNamespace(_accumulation=None))) is None
    with pytest.raises(dataclasses.FrozenInstanceError):  # (read, never changed, by its readers)
        found.schedule = Constant(1)  # type: ignore[misc]
    real = AccumulationScheduler(Constant(4))
    found = steps.accumulating(stand_in(callbacks=[real]))
    assert found is not None and found.schedule == Constant(4) and not found.counted
    assert found.progress() == real.progress


# -- the horizon warning -------------------------------------------------------------------------------------------


def config(horizon: int, attribute: str = "total_steps", interval: str = "step", frequency: int = 1) -> Any:
    return SimpleNamespace(interval=interval, frequency=frequency, scheduler=SimpleNamespace(**{attribute: horizon}))


def horizon_warnings(trainer: Any, optimizers: int = 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps.warn_scheduler_horizons(trainer, optimizers)
    assert all(w.category is SchedulerHorizonWarning for w in caught)
    return [str(w.message) for w in caught]


def test_a_horizon_of_the_fits_steps_is_not_warned() -> None:
    """``Constant(3)``, 2 epochs of 17 batches: 12 steps."""
    assert horizon_warnings(stand_in(Constant(3), lr_scheduler_configs=[config(12), config(12, "T_max")])) == []
    assert horizon_warnings(stand_in(Constant(3), lr_scheduler_configs=[config(6, frequency=2)])) == []
    assert horizon_warnings(stand_in(Constant(3), lr_scheduler_configs=[config(5, frequency=2)])) != []
    assert horizon_warnings(stand_in(Constant(3), lr_scheduler_configs=[config(99, interval="epoch")])) == []
    assert horizon_warnings(stand_in(Constant(3), lr_scheduler_configs=[config(99, "other")])) == []
    assert horizon_warnings(stand_in(Constant(3), max_epochs=-1, lr_scheduler_configs=[config(99)])) == []  # (endless)
    with_max = stand_in(Constant(3), max_steps=7, lr_scheduler_configs=[config(4)])
    assert horizon_warnings(with_max, optimizers=2) == [] and horizon_warnings(with_max) != []
    broken = stand_in(Constant(3), lightning_module=None, lr_scheduler_configs=[config(9, interval="epoch")])
    assert horizon_warnings(broken) == []  # (no step-interval horizon: nothing counted)


def test_a_horizon_not_the_fits_steps_is_warned() -> None:
    t = stand_in(Constant(3), lr_scheduler_configs=[config(34), config(12), config(20, "T_max", frequency=3)])
    got = horizon_warnings(t)
    assert len(got) == 2
    assert got[0].startswith("The LR scheduler SimpleNamespace is sized for 34 steps, but this fit takes 12 (optimizer "
                             "steps) under the accumulation schedule;")  # fmt: skip
    assert "`lightning_accum.estimated_stepping_batches(trainer)`." in got[0]
    assert "is sized for 20 steps, but this fit takes 4 (optimizer steps / frequency 3)" in got[1]
    assert all(m.endswith("category=lightning_accum.SchedulerHorizonWarning)`.)") for m in got)
    got = horizon_warnings(stand_in(Constant(3), max_steps=9, lr_scheduler_configs=[config(9)]), optimizers=2)
    assert got == [m for m in got if "takes 5 " in m and "estimated_stepping_batches(trainer, optimizers=2)`." in m]
    assert len(got) == 1


def test_a_horizon_that_cannot_be_checked_is_warned() -> None:
    t = stand_in(Piecewise({0: 2}, unit="items"), lr_scheduler_configs=[config(34), config(7.0, "T_max")])
    (got,) = horizon_warnings(t)
    assert got.startswith("The LR scheduler SimpleNamespace (total_steps=34), SimpleNamespace (T_max=7) is sized for")
    assert "cannot be known at its start" in got and "cannot be known in advance" in got
    (got,) = horizon_warnings(stand_in(Constant(3), num_training_batches=math.inf, lr_scheduler_configs=[config(3)]))
    assert "no length" in got
