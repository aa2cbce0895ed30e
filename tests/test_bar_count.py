"""``BarCount`` (the step progress bars' counter and total) driven hook by hook on a stand-in Trainer, against an
independent reference: the fit's windows formed one batch at a time, the totals of the estimated schedules worked
out by hand. Host arithmetic, no fit."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import pytest
from torch.utils.data import DataLoader

from lightning_accum import Budget, Constant, Lambda, Piecewise, Ramp
from lightning_accum._trainer.bar_count import BarCount, check_unit
from lightning_accum._trainer.reporting import WindowReport
from lightning_accum.noise import NoiseScale
from lightning_accum.schedules import Progress, Schedule


def stand_in(schedule: Schedule, batches: float = 17, **fields: Any) -> Any:
    """A Trainer as ``BarCount`` reads it (its ``AccumulationScheduler`` a stand-in whose ``progress`` the driver
    sets): an epoch of 17 batches of 2 (the last of 1)."""
    base: dict[str, Any] = dict(
        callbacks=[SimpleNamespace(schedule=schedule, count=None, normalize="mean", progress=Progress())],
        lightning_module=object(), current_epoch=0, num_training_batches=batches, max_steps=-1, global_step=0,
        world_size=1, train_dataloader=DataLoader(range(33), batch_size=2),
    )  # fmt: skip
    base.update(fields)
    return SimpleNamespace(**base)


class Fit:
    """Runs ``BarCount``'s hooks as the bar gets them: the windows formed one batch at a time (a window opens at a
    batch when none is open, asks the schedule then, closes at its k-th batch, when its samples reach a ``Budget``'s
    n, or at the epoch's last batch), ``Progress`` and ``global_step`` moved on at each window's end."""

    def __init__(self, unit: str, schedule: Schedule, world: int = 1, **fields: Any) -> None:
        self.schedule = schedule
        self.trainer = stand_in(schedule, world_size=world, **fields)
        self.world = world
        self.count = BarCount(unit)  # type: ignore[arg-type]
        self.count.start_fit(self.trainer, "Bar")
        self.windows: list[int] = []  # the micro-batches of each window of the epoch under way
        self.changed: list[tuple[str, int, bool]] = []  # what `batch_start` and `window_end` said: the total changed

    @property
    def progress(self) -> Progress:
        return self.trainer.callbacks[0].progress  # type: ignore[no-any-return]

    def sizes(self) -> list[int]:
        return [2 * self.world] * 16 + [self.world]

    def epoch(self, epoch: int, first: int = 0, check: Any = None) -> bool:
        """One epoch from batch ``first``; ``check(count)`` after each hook; whether ``max_steps`` stopped it."""
        self.trainer.current_epoch = epoch
        self.windows = []
        if first == 0:
            self.count.start_epoch(self.trainer)
        open_ = False
        batches = int(self.trainer.num_training_batches)
        for b in range(first, batches):
            if not self.count.started:
                self.count.start_epoch(self.trainer)
            before = self.count.total
            said = self.count.batch_start(self.trainer, b)
            assert said is (self.count.total != before)
            self.changed.append(("batch", b, said))
            if check:
                check(self.count)
            if not open_:
                asked = dataclass_replace(self.progress, epoch=epoch)
                k = self.schedule(asked) if not isinstance(self.schedule, NoiseScale) else 3
                n = self.schedule.budget(asked) if isinstance(self.schedule, Budget) else None
                open_, taken, seen = True, 0, 0
            taken += 1
            seen += self.sizes()[b]
            if taken == k or b == batches - 1 or (n is not None and seen >= n):
                open_ = False
                self.windows.append(taken)
                p = self.progress
                after = Progress(epoch, p.step + 1, p.samples + seen, p.items + seen, p.microbatches + taken)
                self.trainer.callbacks[0].progress = after
                self.trainer.global_step = after.step
                report = WindowReport(step=after.step, epoch=epoch, k=taken if n is not None else k,
                                      microbatches=taken * self.world, samples=seen, items=seen, loss=None,
                                      progress=after, seconds=None)  # fmt: skip
                before = self.count.total
                said = self.count.window_end(self.trainer, report)
                assert said is (self.count.total != before)
                self.changed.append(("window", after.step, said))
                if check:
                    check(self.count)
                if after.step == self.trainer.max_steps:
                    return True
        return False


def dataclass_replace(p: Progress, **changes: Any) -> Progress:
    fields = dict(epoch=p.epoch, step=p.step, samples=p.samples, items=p.items, microbatches=p.microbatches)
    fields.update(changes)
    return Progress(**fields)


def reference_epochs(schedule: Schedule, world: int, epochs: int, max_steps: int) -> list[list[int]]:
    """Each epoch's windows (their micro-batches), one batch at a time; the fit stops at ``max_steps`` windows."""
    sizes = [2 * world] * 16 + [world]
    step = samples = micro = 0
    out: list[list[int]] = []
    for epoch in range(epochs):
        out.append([])
        open_ = False
        for b in range(17):
            if not open_:
                asked = Progress(epoch=epoch, step=step, samples=samples, items=samples, microbatches=micro)
                k = schedule(asked)
                n = schedule.budget(asked) if isinstance(schedule, Budget) else None
                open_, taken, seen = True, 0, 0
            taken += 1
            seen += sizes[b]
            if taken == k or b == 16 or (n is not None and seen >= n):
                step, samples, micro, open_ = step + 1, samples + seen, micro + taken, False
                out[-1].append(taken)
                if step == max_steps:
                    return out
    return out


EXACT = [
    Constant(3), Constant(1), Constant(40), Ramp(1, 5, over=12, unit="step"), Ramp(1, 4, over=30, unit="samples"),
    Piecewise({1: 4}, unit="epoch"), Budget(5, unit="samples"), Budget(9, unit="samples", max_k=2),
    Lambda(lambda p: 1 + p.step % 3, unit="step"),
]  # fmt: skip


@pytest.mark.parametrize("schedule", EXACT, ids=repr)
@pytest.mark.parametrize("unit", ["steps", "batches"])
@pytest.mark.parametrize("max_steps", [-1, 4, 8, 13])
def test_an_exact_total_is_the_epochs_windows(schedule: Schedule, unit: str, max_steps: int) -> None:
    """Walked at the epoch's start: the epoch's windows (``steps``) or the batches they take (``batches``), at most
    the steps ``max_steps`` leaves; unchanged through the epoch, the counter meeting it at the epoch's end."""
    for world in (1, 2):
        want = reference_epochs(schedule, world, 3, max_steps)
        fit = Fit(unit, schedule, world, max_steps=max_steps)
        for epoch, windows in enumerate(want):
            total = len(windows) if unit == "steps" else sum(windows)

            def check(count: BarCount, total: int = total) -> None:
                assert count.total == total

            stopped = fit.epoch(epoch, check=check)
            assert fit.windows == windows
            assert not any(said for _, _, said in fit.changed)  # (walked once, at the epoch's start)
            assert fit.count.steps == len(windows)
            if stopped:
                break
        assert len(want) == 3 or max_steps == sum(map(len, want))


def totals_of(fit: Fit, epoch: int = 0, first: int = 0) -> list[float]:
    """The total after each hook of the epoch (each batch's start, each window's end)."""
    seen: list[float] = []
    fit.epoch(epoch, first, check=lambda count: seen.append(count.total))
    return seen


def at_window_ends(fit: Fit, epoch: int = 0) -> tuple[float, list[float]]:
    """The total at the epoch's first batch, and after each window's end."""
    seen: list[tuple[int, float]] = []
    fit.epoch(epoch, check=lambda count: seen.append((count.steps, count.total)))
    return seen[0][1], [total for (before, _), (steps, total) in itertools.pairwise(seen) if steps != before]


def test_an_estimated_total_follows_the_next_windows_k() -> None:
    """A ``Lambda`` (not walked): at the epoch's start ``ceil(17 / k)``; at each window's end the steps so far plus
    ``ceil(batches left / next k)``. k = 2, 4, 2, 4, ... by step: windows of 2, 4, 2, 4, 2, 3 (cut)."""
    fit = Fit("steps", Lambda(lambda p: 2 + 2 * (p.step % 2)))
    start, ends = at_window_ends(fit)  # (windows ending at batches 1, 5, 7, 11, 13, 16)
    assert start == 9
    assert ends == [1 + 4, 2 + 6, 3 + 3, 4 + 3, 5 + 1, 6]  # (15 left / 4, 11 / 2, 9 / 4, 5 / 2, 3 / 4, none)
    assert [said for what, _, said in fit.changed if what == "window"] == [True, True, True, True, True, False]
    assert not any(said for what, _, said in fit.changed if what == "batch")
    assert fit.count.steps == 6 == fit.count.total


def test_an_estimated_total_in_batches() -> None:
    """``unit="batches"``: the batches left, at most the steps ``max_steps`` leaves times the next k."""
    fit = Fit("batches", Lambda(lambda p: 2 + 2 * (p.step % 2)))
    start, ends = at_window_ends(fit)
    assert start == 17 and ends == [17] * 6
    fit = Fit("batches", Lambda(lambda p: 2 + 2 * (p.step % 2)), max_steps=3)
    # (start: 3 steps of k 2 at most; after the 1st window at batch 2: 2 + 2 * 4; after the 2nd at 6: 6 + 1 * 2)
    assert at_window_ends(fit) == (6, [2 + 8, 6 + 2, 8])


def test_a_noise_scales_total_follows_the_last_windows_k() -> None:
    """``NoiseScale``: the last window's k (1 before any window)."""
    fit = Fit("steps", NoiseScale(2, 8))  # (the driver's windows: k 3)
    assert at_window_ends(fit) == (17, [1 + 5] * 6)  # (k 1: 17 windows; then 14 left / 3 and so on)
    assert fit.count.steps == 6 == fit.count.total


def test_a_budget_of_items_total_follows_the_mean_window() -> None:
    """A ``Budget`` of items (not walked): the windows' mean micro-batches so far, at least 1, at most its cap."""
    schedule = Budget(5, unit="items", max_k=8)
    fit = Fit("steps", schedule)  # (the driver closes at 5 samples: windows of 3 batches)
    assert at_window_ends(fit) == (17, [6] * 6)  # (no window yet: k 1; then the mean 3: 1 + ceil(14 / 3), ...)
    capped = Fit("steps", Budget(5, unit="items", max_k=2))
    assert at_window_ends(capped) == (17, [9] * 9)  # (windows of 2, the cap: 1 + ceil(15 / 2), ...)


def test_a_budget_window_mean_rounds() -> None:
    """The mean of windows of 1 and 2 micro-batches (1.5) rounds to 2; of 1, 1, 2 (1.33) to 1."""
    count = BarCount("steps")
    trainer = stand_in(Budget(5, unit="items"))
    count.start_fit(trainer, "Bar")
    count.start_epoch(trainer)
    estimated = count._estimated(Progress(step=2, microbatches=3), Progress(), 3, math.inf)
    assert estimated == math.ceil(14 / 2)
    assert count._estimated(Progress(step=3, microbatches=4), Progress(), 4, math.inf) == 13
    assert count._estimated(Progress(step=3, microbatches=4), Progress(), 4, 5) == 5
    assert count._estimated(Progress(step=1, microbatches=0), Progress(), 4, math.inf) == 13  # (at least 1)


def test_an_endless_loaders_total() -> None:
    """An iterable loader: unbounded, or the steps ``max_steps`` leaves."""
    for unit in ("steps", "batches"):
        trainer = stand_in(Constant(3), math.inf)
        count = BarCount(unit)  # type: ignore[arg-type]
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        assert count.total == math.inf
        trainer = stand_in(Constant(3), math.inf, max_steps=5, global_step=1)
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        assert count.total == (4 if unit == "steps" else 12)
    trainer = stand_in(Lambda(lambda p: 3), math.inf, max_steps=5, global_step=1)
    count = BarCount("batches")
    count.start_fit(trainer, "Bar")
    count.start_epoch(trainer)
    assert count.total == 12  # (estimated: 4 steps of 3)
    trainer.max_steps = -1
    count.start_epoch(trainer)
    assert count.total == math.inf


def test_the_steps_max_steps_leaves() -> None:
    """``max_steps - global_step`` from the epoch's start, never below 0."""
    for global_step, total in [(0, 6), (2, 6), (3, 5), (7, 1), (8, 0), (9, 0)]:
        trainer = stand_in(Constant(3), max_steps=8, global_step=global_step)
        count = BarCount("steps")
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        assert count.total == total, global_step


def test_a_second_epoch_starts_the_count_again() -> None:
    """The steps counted from the epoch's start (``Progress.step`` then); its batches from its first micro-batch."""
    fit = Fit("batches", Constant(4))
    fit.epoch(0)
    assert fit.count.steps == 5 and fit.count.total == 17
    fit.epoch(1)
    assert fit.count.steps == 5 and fit.count.total == 17
    assert fit.count.state_dict() == {"epoch": 1, "first_step": 5, "first_microbatches": 17, "known": True}
    fit.count.start_epoch(fit.trainer)  # (the same epoch again: its start kept)
    assert fit.count.state_dict()["first_step"] == 5 and fit.count.steps == 5


def test_taken_is_each_ranks_micro_batches() -> None:
    """A schedule's k, or fewer where the window was cut (its micro-batches over all ranks, per rank, rounded up); a
    ``Budget``'s k as it is."""
    for schedule, k, microbatches, world, taken in [
        (Constant(4), 4, 8, 2, 4), (Constant(4), 4, 4, 2, 2), (Constant(4), 4, 5, 2, 3), (Constant(4), 4, 3, 1, 3),
        (Constant(4), 4, 12, 2, 4), (Budget(5, unit="samples"), 3, 2, 2, 3), (Budget(5, unit="samples"), 3, 9, 1, 3),
    ]:  # fmt: skip
        trainer = stand_in(schedule, world_size=world)
        count = BarCount("steps")
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        report = WindowReport(1, 0, k, microbatches, 8, 8, None, Progress(step=1, microbatches=k))
        count.window_end(trainer, report)
        assert count.taken == taken, (schedule, k, microbatches, world)
    for world in (None, 0, 1):  # (read as one rank)
        trainer = stand_in(Constant(4), world_size=world)
        count = BarCount("steps")
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        count.window_end(trainer, WindowReport(1, 0, 4, 3, 8, 8, None, Progress(step=1, microbatches=3)))
        assert count.taken == 3


@pytest.mark.parametrize("counted", [False, True])
def test_throughput_and_postfix(counted: bool) -> None:
    """The samples (items with a ``count``) over the window's seconds; the postfix: ``first``, Lightning's metrics
    without ``accum/k`` and ``accum/loss``, then k, batch, tokens, loss and throughput."""
    trainer = stand_in(Constant(4))
    trainer.callbacks[0].count = len if counted else None
    count = BarCount("steps")
    count.start_fit(trainer, "Bar")
    count.start_epoch(trainer)
    assert count.counted is counted
    metrics = {"accum/k": 4.0, "accum/loss": 0.5, "v_num": 1, "acc": 0.25}
    assert count.postfix(metrics) == {"v_num": 1, "acc": 0.25}
    assert metrics == {"accum/k": 4.0, "accum/loss": 0.5, "v_num": 1, "acc": 0.25}  # (not changed)
    count.window_end(trainer, WindowReport(1, 0, 4, 4, 8, 30, 1.5, Progress(step=1, microbatches=4), seconds=4.0))
    assert count.rate == (30 / 4 if counted else 8 / 4)
    want: dict[str, Any] = {"step": "1/6", "v_num": 1, "acc": 0.25, "k": 4, "batch": 8}
    if counted:
        want |= {"tokens": 30, "loss": 1.5, "tokens/s": 8}  # (7.5 rounded to even)
    else:
        want |= {"loss": 1.5, "samples/s": 2}
    got = count.postfix(metrics, first={"step": "1/6"})
    assert got == want and list(got) == list(want) and all(type(got[n]) is int for n in ("k", "batch"))
    text = count.postfix(metrics, text=True)
    assert text == {n: (str(v) if n in ("k", "batch", "tokens", "tokens/s", "samples/s") else v)
                    for n, v in want.items() if n != "step"}  # fmt: skip
    for seconds in (None, 0.0):
        untimed = WindowReport(2, 0, 4, 4, 8, 30, None, Progress(step=2, microbatches=8), seconds=seconds)
        count.window_end(trainer, untimed)
        assert count.rate is None
        assert "loss" not in count.postfix({}) and "samples/s" not in count.postfix({})
        assert "tokens/s" not in count.postfix({})


def test_a_fit_without_accumulation_is_refused() -> None:
    trainer = stand_in(Constant(2), callbacks=[], lightning_module=None)
    with pytest.raises(RuntimeError, match=r"^MyBar counts the windows of an `AccumulationScheduler`"):
        BarCount("steps").start_fit(trainer, "MyBar")


def test_start_fit_forgets_the_last_fits_window() -> None:
    fit = Fit("steps", Constant(3))
    fit.epoch(0)
    assert fit.count.last is not None and fit.count.started
    fit.count.start_fit(fit.trainer, "Bar")
    assert (fit.count.last, fit.count.rate, fit.count.started) == (None, None, False)
    assert fit.count.postfix({}) == {}


def test_resumed_with_the_bars_state() -> None:
    """A fit resumed inside epoch 0 (after 2 windows of 3) with the bar's state: the epoch's start is known, its steps
    counted from it, the total exact."""
    first = Fit("steps", Constant(3))
    first.epoch(0, check=lambda count: None)
    state = first.count.state_dict()
    assert state == {"epoch": 0, "first_step": 0, "first_microbatches": 0, "known": True}
    fit = Fit("steps", Constant(3))
    fit.trainer.callbacks[0].progress = Progress(step=2, samples=12, items=12, microbatches=6)
    fit.trainer.global_step = 2
    fit.count.load_state_dict(state)
    fit.count.start_fit(fit.trainer, "Bar")
    seen = totals_of(fit, 0, first=6)
    assert seen == [6] * len(seen) and fit.count.steps == 6


def test_resumed_without_the_bars_state() -> None:
    """Without it: the steps counted from the resume, the total unknown (inf) until a window ended, then the steps
    so far plus those the batches left take (``unit="steps"``); in batches known from the resume's batch."""
    fit = Fit("steps", Constant(3))
    fit.trainer.callbacks[0].progress = Progress(step=2, samples=12, items=12, microbatches=6)
    fit.trainer.global_step = 2
    seen = totals_of(fit, 0, first=6)
    assert seen[:3] == [math.inf] * 3  # (batches 6, 7, 8; the window ends at 8)
    assert fit.changed[:4] == [("batch", 6, True), ("batch", 7, False), ("batch", 8, False), ("window", 3, True)]
    assert seen[3:] == [1 + 3] * (len(seen) - 3)  # (8 batches left: 3 windows)
    assert fit.count.steps == 4 == fit.count.total
    assert fit.count.state_dict() == {"epoch": 0, "first_step": 2, "first_microbatches": 6, "known": False}
    fit.epoch(1)  # (the next epoch: known again)
    assert fit.count.state_dict() == {"epoch": 1, "first_step": 6, "first_microbatches": 17, "known": True}
    assert fit.count.total == 6 == fit.count.steps
    batches = Fit("batches", Constant(3))
    batches.trainer.callbacks[0].progress = Progress(step=2, samples=12, items=12, microbatches=6)
    seen = totals_of(batches, 0, first=6)
    assert seen == [17] * len(seen)  # (6 + 11 batches left)
    assert batches.changed[0] == ("batch", 6, False)  # (17 at the epoch's start too)


def test_resumed_from_a_resume_without_the_bars_state() -> None:
    """A checkpoint of a fit itself resumed without the bar's state (``known`` False): the steps go on from its
    count."""
    fit = Fit("steps", Constant(3))
    fit.count.load_state_dict({"epoch": 0, "first_step": 2, "first_microbatches": 0, "known": False})
    fit.count.start_fit(fit.trainer, "Bar")
    fit.trainer.callbacks[0].progress = Progress(step=3, samples=18, items=18, microbatches=9)
    fit.trainer.global_step = 3
    seen = totals_of(fit, 0, first=9)
    assert fit.count.steps == 1 + 3 and fit.count.total == 4  # (counted from step 2: 1 before the resume, 3 after)
    assert seen[:3] == [math.inf] * 3 and seen[3:] == [4] * (len(seen) - 3)  # (unknown until a window ended)


def test_a_checkpoint_is_read_once() -> None:
    """A loaded state serves the next ``start_fit``; a later fit of the same bar without a checkpoint starts afresh."""
    count = BarCount("steps")
    count.load_state_dict({"epoch": 3, "first_step": 7, "first_microbatches": 9, "known": False})
    trainer = stand_in(Constant(3), current_epoch=3)
    trainer.callbacks[0].progress = Progress(step=9, microbatches=12)
    count.start_fit(trainer, "Bar")
    count.start_epoch(trainer)
    assert count.state_dict() == {"epoch": 3, "first_step": 7, "first_microbatches": 9, "known": False}
    assert count.steps == 2 and count.total == math.inf
    count.start_fit(trainer, "Bar")  # (no checkpoint this time)
    count.start_epoch(trainer)
    assert count.state_dict() == {"epoch": 3, "first_step": 9, "first_microbatches": 12, "known": True}
    assert count.steps == 0
    count.load_state_dict({})
    assert count.state_dict() == {"epoch": -1, "first_step": 0, "first_microbatches": 0, "known": True}


@pytest.mark.parametrize(
    "unit, error, hint",
    [(5, TypeError, None), (None, TypeError, None), (b"steps", TypeError, None), ("step", ValueError, "'steps'"),
     ("Steps", ValueError, "'steps'"), ("STEP", ValueError, "'steps'"), ("optimizer_steps", ValueError, "'steps'"),
     ("batch", ValueError, "'batches'"), ("Batches", ValueError, "'batches'"),
     ("MicroBatches", ValueError, "'batches'"), ("epochs", ValueError, None), ("", ValueError, None)],
)  # fmt: skip
def test_unit_refused(unit: Any, error: type, hint: str | None) -> None:
    with pytest.raises(error, match=r"^`Bar\(unit=\.\.\.\)` takes 'steps'") as raised:
        check_unit(unit, "Bar")
    said = str(raised.value)
    assert said.endswith(f" Did you mean {hint}?") if hint else "Did you mean" not in said


def test_unit_taken() -> None:
    assert check_unit("steps", "Bar") == "steps" and check_unit("batches", "Bar") == "batches"


def test_an_endless_loaders_total_under_a_samples_schedule() -> None:
    """An iterable loader under a schedule keyed on samples (no sizes asked of it): the walk bounded by ``max_steps``
    (k 1 at first: 3 steps in batches), or estimated from the next k past the walk."""
    ramp = Ramp(1, 4, over=30, unit="samples")
    for unit, want in (("steps", 3), ("batches", 3)):
        trainer = stand_in(ramp, math.inf, max_steps=3)
        count = BarCount(unit)  # type: ignore[arg-type]
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        assert count.total == want
        trainer.max_steps = -1
        count.start_epoch(trainer)
        assert count.total == math.inf


def test_resumed_at_the_second_batch_without_the_bars_state() -> None:
    """Resumed at batch 1 (one window of 1 closed): the first batch's start is a resume too."""
    fit = Fit("steps", Constant(1))
    fit.trainer.callbacks[0].progress = Progress(step=1, samples=2, items=2, microbatches=1)
    fit.trainer.global_step = 1
    seen = totals_of(fit, 0, first=1)
    assert seen[0] == math.inf and seen[1:] == [16] * (len(seen) - 1)  # (the steps since the resume: 16)
    assert fit.count.steps == 16


def test_max_steps_reached_leaves_nothing() -> None:
    for unit in ("steps", "batches"):
        for max_steps, global_step in ((0, 0), (4, 4)):
            trainer = stand_in(Lambda(lambda p: 2), max_steps=max_steps, global_step=global_step)
            count = BarCount(unit)  # type: ignore[arg-type]
            count.start_fit(trainer, "Bar")
            count.start_epoch(trainer)
            assert count.total == 0


def test_a_walked_schedule_reading_the_items_a_count_gives_is_estimated() -> None:
    """A ``Lambda`` keyed on steps (walked) that reads ``items``: with a ``count`` the walk does not know them, so the
    total is estimated from the next window's k, asked with the fit's ``Progress``; without one it is walked."""
    reads_items = Lambda(lambda p: 2 if p.items < 100 else 5, unit="step")
    for counted in (False, True):
        trainer = stand_in(reads_items)
        trainer.callbacks[0].count = len if counted else None
        trainer.callbacks[0].progress = Progress(step=3, samples=12, items=200 if counted else 12, microbatches=6)
        count = BarCount("steps")
        count.start_fit(trainer, "Bar")
        count.start_epoch(trainer)
        assert count.total == (math.ceil(17 / 5) if counted else math.ceil(17 / 2))
        if counted:  # (estimated from then on: each window's end works the total out again)
            for batch in range(5):
                count.batch_start(trainer, batch)
            count.window_end(trainer, WindowReport(4, 0, 5, 5, 10, 300, None, Progress(4, 4, 22, 300, 11)))
            assert count.total == 1 + math.ceil(12 / 5)


def test_a_second_fit_of_the_bar_starts_afresh() -> None:
    """The same bar in a second fit (no checkpoint), whose epoch 0 is the last fit's too: its start taken anew."""
    fit = Fit("steps", Constant(3))
    fit.epoch(0)
    assert fit.count.state_dict() == {"epoch": 0, "first_step": 0, "first_microbatches": 0, "known": True}
    fit.trainer.callbacks[0].progress = Progress()  # (a new fit: its own Progress)
    fit.trainer.global_step = 0
    fit.count.start_fit(fit.trainer, "Bar")
    fit.trainer.callbacks[0].progress = Progress(step=6, samples=33, items=33, microbatches=17)
    fit.trainer.current_epoch = 0
    fit.count.start_epoch(fit.trainer)  # (Progress moved on, e.g. a fit that restored its loop but not the bar)
    assert fit.count.state_dict() == {"epoch": 0, "first_step": 6, "first_microbatches": 17, "known": True}
    assert fit.count.steps == 0


def test_a_checkpoint_written_before_known_existed_is_a_known_epoch_start() -> None:
    """A bar's state without the ``known`` entry (a checkpoint written before it existed) is a resume whose epoch
    start is known, as ``known=True`` says: the same totals and steps (exact from the resume: 6, the counter from the
    epoch's start), not those of ``known=False`` (the steps counted from the resume, the total unknown at first)."""

    def resumed(state: dict[str, Any]) -> tuple[list[float], int]:
        fit = Fit("steps", Constant(3))
        fit.trainer.callbacks[0].progress = Progress(step=2, samples=12, items=12, microbatches=6)
        fit.trainer.global_step = 2
        fit.count.load_state_dict(state)
        fit.count.start_fit(fit.trainer, "Bar")
        return totals_of(fit, 0, first=6), fit.count.steps

    old = {"epoch": 0, "first_step": 0, "first_microbatches": 0}  # (no "known")
    seen, counted = resumed(old)
    assert seen == [6] * len(seen) and counted == 6
    assert (seen, counted) == resumed({**old, "known": True})
    unknown, counted_unknown = resumed({**old, "known": False})
    assert unknown[0] == math.inf and (unknown, counted_unknown) != (seen, counted)
