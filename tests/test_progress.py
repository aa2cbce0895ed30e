"""``StepProgressBar`` and ``RichStepProgressBar``: the training bar's counter and total against what the fit
really ran (the windows announced to another callback, the batches Lightning trained), the postfix, resume,
misuse."""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import AccumulationScheduler, Budget, Constant, Lambda, Piecewise, Ramp
from lightning_accum._trainer.reporting import Readers
from lightning_accum.progress import RichStepProgressBar, StepProgressBar

from helpers import ManualTokenModel, ResumableLoader, TokenData, TokenModel, count_tokens, loader, params_of, trainer

DATA = TokenData(32, seed=1)  # 16 batches of 2


class Seen(pl.Callback):
    """What the fit ran, epoch by epoch (windows announced, batches trained), and the bar's counter and total
    at every batch's end (listed after the bar and the accumulation: it sees what they left)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.epochs: list[dict[str, Any]] = []
        self.tokens = 0
        self.fit: list[tuple[int, float]] = []  # the fit's steps (done, total) as drawn at every batch's end

    def drawn_fit(self) -> tuple[int, float] | None:
        """(done, total) of the fit's steps as the bar draws them (TQDM's postfix, Rich's overall bar)."""
        if isinstance(self.bar, StepProgressBar):
            found = re.search(r"step=(\d+)/(\d+|\?)", self.bar.train_progress_bar.postfix or "")
            if found is None:
                return None
            return int(found[1]), math.inf if found[2] == "?" else int(found[2])
        task = self.bar.fit_progress_bar
        return None if task is None else (int(task.completed), task.total)

    def drawn(self) -> tuple[float, float | None]:
        """(counter, total) as the bar draws them."""
        if isinstance(self.bar, StepProgressBar):
            tq = self.bar.train_progress_bar
            return tq.n, tq.total
        task = self.bar.progress.tasks[self.bar.train_progress_bar_id]
        return task.completed, task.total

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.epochs.append({"epoch": trainer.current_epoch, "first_total": self.drawn()[1], "steps": 0, "batches": 0})
        self.epochs[-1]["passed"], self.epochs[-1]["drawn"] = [], []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.epochs or self.epochs[-1]["epoch"] != trainer.current_epoch:  # (resumed inside the epoch)
            self.on_train_epoch_start(trainer, None)

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        self.epochs[-1]["steps"] += 1
        self.tokens += window.items

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.epochs[-1]["batches"] += 1
        n, total = self.drawn()
        self.epochs[-1]["drawn"].append(n)
        if total is not None and not math.isinf(total) and n > total:
            self.epochs[-1]["passed"].append((n, total))
        fit = self.drawn_fit()
        if fit is not None:
            self.fit.append(fit)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.epochs[-1]["last"] = self.drawn()


class Endless(IterableDataset[Any]):
    """An iterable (length-free) loader's data: DATA's batches of 2, again and again."""

    def __iter__(self) -> Iterator[Any]:
        while True:
            for i in range(0, len(DATA), 2):
                yield DATA.batch(slice(i, i + 2))


def fit(
    bar: Any, schedule: Any, *, data: Any = None, model: Any = None, callbacks_after: Any = (), **kwargs: Any
) -> Seen:
    seen = Seen(bar)
    count = kwargs.pop("count", None)
    accumulation = [] if model is not None else [AccumulationScheduler(schedule, count=count)]
    t = trainer(callbacks=[*accumulation, bar, seen, *callbacks_after], enable_progress_bar=True, **kwargs)
    t.fit(model or TokenModel(), data if data is not None else loader(DATA, 2))
    return seen


def expected(seen: Seen, unit: str) -> list[int]:
    return [e["steps" if unit == "steps" else "batches"] for e in seen.epochs]


def rich_bar(unit: str) -> RichStepProgressBar:
    return RichStepProgressBar(unit=unit, console_kwargs={"file": io.StringIO(), "width": 200})


BARS = {"tqdm": StepProgressBar, "rich": rich_bar}
# exact at the epoch's start: the total the schedule gives is what the fit runs
EXACT: dict[str, tuple[Any, dict[str, Any]]] = {
    "constant": (3, {}),
    "piecewise over samples": (Piecewise({0: 1, 12: 3, 20: 4}, unit="samples"), {}),
    "ramp over samples": (Ramp(1, 5, over=40, unit="samples"), {}),
    "max_steps cuts an epoch": (Piecewise({0: 2, 3: 3}, unit="step"), {"max_steps": 9, "max_epochs": 4}),
    "limit_train_batches": (Ramp(1, 4, over=12, unit="step"), {"limit_train_batches": 11}),
    "iterable, max_steps": (Piecewise({0: 2, 4: 5}, unit="step"), {"max_steps": 7, "data": "endless"}),
}


@pytest.mark.parametrize("name", list(EXACT))
@pytest.mark.parametrize("kind, unit", [("tqdm", "steps"), ("rich", "batches")])
def test_totals_are_the_fits_steps_or_batches(name: str, kind: str, unit: str) -> None:
    schedule, kwargs = EXACT[name]
    kwargs = dict(kwargs)
    if kwargs.get("data") == "endless":
        kwargs["data"] = DataLoader(Endless(), batch_size=None)
    seen = fit(BARS[kind](unit), schedule, **kwargs)
    realised = expected(seen, unit)
    assert [e["first_total"] for e in seen.epochs] == realised  # known from the epoch's start
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]
    assert all(not e["passed"] for e in seen.epochs)
    # the fit's steps: the total (min of max_steps and the schedule's over max_epochs) from the first draw on
    fit_steps = sum(e["steps"] for e in seen.epochs)
    assert seen.fit and {total for _, total in seen.fit} == {fit_steps}
    assert [done for done, _ in seen.fit] == sorted(done for done, _ in seen.fit)
    assert seen.fit[-1] == (fit_steps, fit_steps)


# the other bar and unit, on the cases where they differ most
@pytest.mark.parametrize("name", ["piecewise over samples", "iterable, max_steps"])
@pytest.mark.parametrize("kind, unit", [("tqdm", "batches"), ("rich", "steps")])
def test_totals_other_unit(name: str, kind: str, unit: str) -> None:
    test_totals_are_the_fits_steps_or_batches(name, kind, unit)


# schedules the walk cannot know ahead: the total is worked out again at each window's end, never passed, met
@pytest.mark.parametrize(
    "schedule", [Ramp(1, 5, over=60, unit="items"), Lambda(lambda p: 1 + p.step % 3)], ids=["items", "lambda"]
)
@pytest.mark.parametrize("kind, unit", [("tqdm", "steps"), ("rich", "batches")])
def test_totals_found_as_the_epoch_goes(schedule: Any, kind: str, unit: str) -> None:
    seen = fit(BARS[kind](unit), schedule, count=count_tokens)
    realised = expected(seen, unit)
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]
    assert all(not e["passed"] for e in seen.epochs)
    # the fit's total is not known in advance: unbounded without max_steps
    assert seen.fit[-1] == (sum(e["steps"] for e in seen.epochs), math.inf)
    assert {total for _, total in seen.fit} == {math.inf}


class StopAfter(pl.Callback):
    """Stops the fit after ``n`` batches (an endless fit's end)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.n -= 1
        trainer.should_stop = self.n <= 0


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
@pytest.mark.parametrize("schedule", [Constant(3), Ramp(1, 4, over=40, unit="samples")], ids=["constant", "ramp"])
def test_an_endless_fits_total_is_unbounded(kind: str, schedule: Any) -> None:
    """``max_epochs=-1`` without ``max_steps``: the fit's total is unbounded (``?``) from the first draw, and the
    epoch's total is still its windows."""
    seen = fit(BARS[kind]("steps"), schedule, max_epochs=-1, callbacks_after=[StopAfter(20)])
    assert seen.fit and {total for _, total in seen.fit} == {math.inf}
    assert seen.epochs[0]["first_total"] == seen.epochs[0]["steps"]


class Totals(Seen):
    """``Seen``, with the bar's total as drawn at each batch's end, epoch by epoch."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self.epochs[-1]["totals"] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        self.epochs[-1]["totals"].append(self.drawn()[1])


def fit_totals(bar: Any, schedule: Any, data: TokenData, **kwargs: Any) -> Totals:
    seen = Totals(bar)
    callback = AccumulationScheduler(schedule, **kwargs)
    trainer(callbacks=[callback, bar, seen], enable_progress_bar=True).fit(TokenModel(), loader(data, 2))
    return seen


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_a_budgets_total_follows_the_windows_mean_size_capped_by_max_k(kind: str) -> None:
    """Under a ``Budget`` of items the total is worked out from the windows' mean size so far, at most ``max_k``.
    Every batch here holds 10 tokens: ``Budget(20, max_k=4)`` closes every window after 2 batches, 8 windows an epoch
    (by hand). Before any window the total is an upper bound (windows of 1 batch); from the first window's end on it
    is the epoch's real 8, as every window has the mean size."""
    data = TokenData(32, seed=1, ragged=False)  # 5 tokens a sample
    seen = fit_totals(BARS[kind]("steps"), Budget(20, unit="items", max_k=4), data, count=count_tokens)
    assert expected(seen, "steps") == [8, 8]
    first, second = seen.epochs
    assert first["first_total"] >= 8 and first["totals"][1:] == [8] * 15
    assert second["first_total"] == 8 and second["totals"] == [8] * 16


def test_an_estimated_total_counts_the_short_last_window_as_a_step() -> None:
    """Where the walk cannot know the windows (a function reading the items a ``count`` gives), the epoch's total is
    estimated from the next window's k: 16 batches in windows of 3 are 6 steps, the last window's one batch a step of
    its own (the estimate rounds up)."""
    seen = fit(StepProgressBar("steps"), Lambda(lambda p: 3 + 0 * p.items), count=count_tokens)
    assert [e["first_total"] for e in seen.epochs] == expected(seen, "steps") == [6, 6]


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_fit_total_found_in_no_walk_is_max_steps(kind: str) -> None:
    seen = fit(BARS[kind]("steps"), Ramp(1, 5, over=60, unit="items"), count=count_tokens, max_steps=5)
    assert sum(e["steps"] for e in seen.epochs) == 5
    assert {total for _, total in seen.fit} == {5} and seen.fit[-1] == (5, 5)


def test_mixin_steps() -> None:
    bar = StepProgressBar()
    seen = fit(bar, None, model=ManualTokenModel(schedule=Piecewise({0: 2, 1: 5}, unit="epoch")), max_epochs=2)
    assert [e["first_total"] for e in seen.epochs] == [e["steps"] for e in seen.epochs] == [8, 4]
    assert [e["last"] for e in seen.epochs] == [(8, 8), (4, 4)]
    assert {total for _, total in seen.fit} == {12} and seen.fit[-1] == (12, 12)


def test_rendered_frames_show_the_window() -> None:
    bar = StepProgressBar()
    fit(bar, Constant(4), count=count_tokens, max_epochs=2)
    frame = str(bar.train_progress_bar)
    assert frame.startswith("Epoch 1: 100%"), frame
    for field in ("4/4", "step=8/8", "k=4", "batch=8", "tokens=", "loss=", "tokens/s="):
        assert field in frame, frame
    rich = rich_bar("steps")
    fit(rich, Constant(4), max_epochs=2)
    console = rich.progress.console if rich.progress is not None else None
    text = console.file.getvalue() if console is not None else ""  # type: ignore[union-attr]
    lines = [line for line in text.splitlines() if line.strip()]
    overall, epoch = lines[-2:]  # (the last frame: the overall bar above the epoch's)
    assert overall.startswith("Steps") and "8/8" in overall and "k:" not in overall, text
    assert epoch.startswith("Epoch 1/1") and "4/4" in epoch, text
    for field in ("k: 4", "batch: 8", "loss:", "samples/s:"):
        assert field in epoch, text


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
@pytest.mark.parametrize("mixin", [False, True])
def test_k_is_the_micro_batches_the_window_took(kind: str, mixin: bool) -> None:
    """The postfix's ``k`` is the last window's micro-batches: 3 in the epoch's windows of ``Constant(3)``, 1 in its
    last (16 batches of 2: five windows of 3 and one of 1), beside its ``batch`` of 2 samples (before issue 53 the
    bar showed ``k=3`` beside ``batch=2``)."""
    bar = BARS[kind]("steps")
    shown: list[str] = []

    class Frame(pl.Callback):  # (after the bar: what it draws at each batch's end)
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            shown.append(str(bar.get_metrics(trainer, pl_module)))

    model = ManualTokenModel(schedule=3) if mixin else TokenModel()
    accumulation = [] if mixin else [AccumulationScheduler(3)]
    trainer(callbacks=[*accumulation, bar, Frame()], enable_progress_bar=True, max_epochs=1).fit(model, loader(DATA, 2))
    k = [re.search(r"k.?[=:]\D*(\d+)", frame) for frame in shown]
    batch = [re.search(r"batch.?[=:]\D*(\d+)", frame) for frame in shown]
    assert [int(m[1]) for m in k if m] == [3] * 13 + [1]  # (shown from the first window's last batch on)
    assert [int(m[1]) for m in batch if m] == [6] * 13 + [2]


class SaveAt(pl.Callback):
    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.at:
            trainer.save_checkpoint(self.path)


# saved at batch 4 of epoch 0, inside the window of batches 3-5 (k = 3): 6 windows an epoch, 1 stepped then
@pytest.mark.parametrize("bar_in_checkpoint", [True, False], ids=["bar's state", "none"])
def test_resume_inside_a_window(tmp_path: Path, bar_in_checkpoint: bool) -> None:
    path = tmp_path / "inside.ckpt"
    saved_with = [StepProgressBar()] if bar_in_checkpoint else []
    callbacks = [AccumulationScheduler(3), *saved_with, SaveAt(4, path)]
    t = trainer(callbacks=callbacks, max_epochs=1, enable_progress_bar=bar_in_checkpoint)
    t.fit(TokenModel(), ResumableLoader(DATA, 2))
    bar = StepProgressBar()
    seen = Seen(bar)
    t = trainer(callbacks=[AccumulationScheduler(3), bar, seen], enable_progress_bar=True, max_epochs=2)
    t.fit(TokenModel(), ResumableLoader(DATA, 2), ckpt_path=path)
    if bar_in_checkpoint:  # the position as the uninterrupted fit showed it
        assert [e["first_total"] for e in seen.epochs] == [6, 6]
        assert [e["last"] for e in seen.epochs] == [(6, 6), (6, 6)]
    else:  # counted from the resume: the window under way and the 4 after it
        assert [e["last"] for e in seen.epochs] == [(5, 5), (6, 6)]
    assert all(not e["passed"] for e in seen.epochs)
    # the fit's steps count the window stepped before the checkpoint: 2 at the first window's end after it
    assert seen.fit[0] == (2, 12) and seen.fit[-1] == (12, 12)


class SaveAtEpochEnd(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


def test_resume_at_an_epochs_end_without_the_bars_state(tmp_path: Path) -> None:
    """A fit resumed at epoch 1 from a checkpoint without the bar's state counts that epoch from its own start:
    ceil(16 / 3) = 6 windows, none of epoch 0's."""
    path = tmp_path / "end.ckpt"
    t = trainer(callbacks=[AccumulationScheduler(3), SaveAtEpochEnd(path)], max_epochs=1, enable_progress_bar=False)
    t.fit(TokenModel(), ResumableLoader(DATA, 2))
    bar = StepProgressBar()
    seen = Seen(bar)
    t = trainer(callbacks=[AccumulationScheduler(3), bar, seen], enable_progress_bar=True, max_epochs=2)
    t.fit(TokenModel(), ResumableLoader(DATA, 2), ckpt_path=path)
    assert [(e["epoch"], e["first_total"], e["last"]) for e in seen.epochs] == [(1, 6, (6, 6))]
    assert seen.fit[-1] == (12, 12)


class SaveAtStart(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


# resumed from a checkpoint saved inside a window (batch 4, the window of batches 3-5), a checkpoint written at
# once (at the train start, or at the first batch's end, which closes that window), then resumed from that one
@pytest.mark.parametrize("when", ["train start", "first batch"])
@pytest.mark.parametrize("bar_in_checkpoint", [True, False], ids=["bar's state", "none"])
@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_checkpoint_right_after_a_resume(tmp_path: Path, kind: str, bar_in_checkpoint: bool, when: str) -> None:
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    saved_with = [BARS[kind]("steps")] if bar_in_checkpoint else []  # (a bar's state is its class's)
    t = trainer(callbacks=[AccumulationScheduler(3), *saved_with, SaveAt(4, first)], max_epochs=1,
                enable_progress_bar=bar_in_checkpoint)  # fmt: skip
    t.fit(TokenModel(), ResumableLoader(DATA, 2))
    save = SaveAtStart(second) if when == "train start" else SaveAt(5, second)
    t = trainer(callbacks=[AccumulationScheduler(3), BARS[kind]("steps"), save], max_epochs=1, enable_progress_bar=True)
    t.fit(TokenModel(), ResumableLoader(DATA, 2), ckpt_path=first)
    bar = BARS[kind]("steps")
    seen = Seen(bar)
    t = trainer(callbacks=[AccumulationScheduler(3), bar, seen], enable_progress_bar=True, max_epochs=2)
    t.fit(TokenModel(), ResumableLoader(DATA, 2), ckpt_path=second)
    # as the first resumed fit showed it: the epoch's 6 windows where the first checkpoint knew where the epoch
    # began; else counted from the first resume (the window under way at batch 4 and the 4 after it)
    assert [e["last"] for e in seen.epochs] == [(6, 6) if bar_in_checkpoint else (5, 5), (6, 6)]
    assert all(not e["passed"] for e in seen.epochs)
    assert seen.fit[-1] == (12, 12) and {total for _, total in seen.fit} == {12}


@pytest.mark.parametrize(
    "unit, error",
    [("step", ValueError), ("Steps", ValueError), ("batch", ValueError), ("", ValueError), (0, TypeError),
     (None, TypeError), (float("nan"), TypeError), (["steps"], TypeError)],
)  # fmt: skip
@pytest.mark.parametrize("cls", [StepProgressBar, RichStepProgressBar])
def test_unit_refused(cls: type, unit: Any, error: type) -> None:
    with pytest.raises(error, match=r"unit=.*'steps'.*'batches'"):
        cls(unit=unit)


def test_a_fit_without_accumulation_is_refused_before_training() -> None:
    model = TokenModel()
    before = [p.detach().clone() for p in params_of(model)]
    with pytest.raises(RuntimeError, match="StepProgressBar counts the windows of an `AccumulationScheduler`"):
        trainer(callbacks=[StepProgressBar()], enable_progress_bar=True).fit(model, loader(DATA, 2))
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True))


def test_the_bar_asks_for_no_gradient_norm() -> None:
    bar = StepProgressBar()
    light = Readers(log=False, loggers=False, every=50, bar=True, hooks=[bar.on_window_end], watched=())
    full = Readers(log=False, loggers=False, every=50, bar=True, hooks=[Seen(bar).on_window_end], watched=())
    assert light.wants(step=3).hooks and not light.wants(step=3).norm
    assert full.wants(step=3).norm


class Rates(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[float, float, float, float]] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        metrics = trainer.callback_metrics
        assert window.seconds is not None and window.seconds > 0
        self.seen.append((
            float(metrics["accum/tokens_per_second"]), window.items / window.seconds,
            float(metrics["accum/samples_per_second"]), window.samples / window.seconds,
        ))  # fmt: skip


@pytest.mark.parametrize("mixin", [False, True], ids=["callback", "mixin"])
def test_throughput_logged_per_window(mixin: bool) -> None:
    rates = Rates()
    schedule = Ramp(1, 4, over=20, unit="samples")
    if mixin:
        model: Any = ManualTokenModel(schedule=schedule, normalize="items", count=count_tokens, reduction="sum")
        t = trainer(callbacks=[rates], max_epochs=1)
    else:
        model = TokenModel(reduction="sum")
        accumulation = AccumulationScheduler(schedule, normalize="items", count=count_tokens, reduction="sum")
        t = trainer(callbacks=[accumulation, rates], max_epochs=1)
    t.fit(model, loader(DATA, 2))
    assert len(rates.seen) == 9  # (k 1, 1, 1, 1, 2, 2, 3, 4 and a last window cut to 1 batch by the epoch)
    for logged_tokens, tokens, logged_samples, samples in rates.seen:
        assert logged_tokens == pytest.approx(tokens, rel=1e-6) and logged_samples == pytest.approx(samples, rel=1e-6)
        assert tokens > samples  # (tokens: the windows' counted items)


class Validated(pl.Callback):
    """The validation bar as drawn at each validation batch's end, and the training bar's counter just before
    and just after each validation."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.seen = bar, Seen(bar)
        self.val: list[tuple[float, float | None]] = []
        self.around: list[tuple[float, float]] = []

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.around.append((self.seen.drawn()[0], math.nan))

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if isinstance(self.bar, StepProgressBar):
            val = self.bar.val_progress_bar
            self.val.append((val.n, val.total))
        else:
            task = self.bar.val_sanity_check_bar if trainer.sanity_checking else self.bar.val_progress_bar
            self.val.append((task.completed, task.total))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.around[-1] = (self.around[-1][0], self.seen.drawn()[0])


class Validating(TokenModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


class ValidatingMixin(ManualTokenModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


# validation every 5 batches (inside the windows of k = 3) and at each epoch's end, 3 batches each; the sanity
# check's 2: the validation bars are Lightning's, the training bar neither moves nor loses its count
@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_validation_bars_unchanged(kind: str) -> None:
    bar = BARS[kind]("steps")
    validated = Validated(bar)
    model = Validating()
    t = trainer(callbacks=[AccumulationScheduler(3), bar, validated.seen, validated], enable_progress_bar=True,
                max_epochs=2, val_check_interval=5, num_sanity_val_steps=2)  # fmt: skip
    t.fit(model, loader(DATA, 2), loader(TokenData(6), 2))
    assert validated.val == [(1, 2), (2, 2), *[(i, 3) for i in (1, 2, 3)] * 6]
    assert len(validated.around) == 6 and all(before == after for before, after in validated.around)
    assert [e["last"] for e in validated.seen.epochs] == [(6, 6), (6, 6)]


@pytest.mark.parametrize(
    "rate, error",
    [(-1, ValueError), (1.5, TypeError), ("2", TypeError), (None, TypeError), (True, TypeError),
     (float("nan"), TypeError)],
)  # fmt: skip
@pytest.mark.parametrize("cls", [StepProgressBar, RichStepProgressBar])
def test_refresh_rate_refused(cls: type, rate: Any, error: type) -> None:
    with pytest.raises(error, match=r"refresh_rate=.*integer >= 0.*0 hides it"):
        cls(refresh_rate=rate)


class Windows(pl.Callback):
    def __init__(self) -> None:
        self.per_epoch: list[int] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        self.per_epoch += [0] * (trainer.current_epoch + 1 - len(self.per_epoch))
        self.per_epoch[trainer.current_epoch] += 1


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_refresh_rate_zero_hides_the_bar_and_keeps_its_state(kind: str, capsys: Any) -> None:
    bar = StepProgressBar(refresh_rate=0) if kind == "tqdm" else RichStepProgressBar(refresh_rate=0)
    windows = Windows()
    t = trainer(callbacks=[AccumulationScheduler(3), bar, windows], enable_progress_bar=True, max_epochs=2)
    t.fit(TokenModel(), loader(DATA, 2))
    assert "Epoch" not in capsys.readouterr().err
    if kind == "tqdm":
        assert bar.train_progress_bar.disable
    else:
        assert bar.progress is None and bar.fit_progress_bar is None
    # counted all the same: a checkpoint holds where the last epoch began (6 windows an epoch)
    assert windows.per_epoch == [6, 6]
    assert bar.state_dict() == {"epoch": 1, "first_step": 6, "first_microbatches": 16, "known": True}


# TQDM draws every `refresh_rate` counts and at the total; Rich refreshes `refresh_rate` times a second
@pytest.mark.parametrize("kind, unit", [("tqdm", "steps"), ("tqdm", "batches"), ("rich", "steps")])
def test_refresh_rate_above_one(kind: str, unit: str) -> None:
    if kind == "tqdm":
        bar: Any = StepProgressBar(unit, refresh_rate=4)
    else:
        bar = RichStepProgressBar(unit, refresh_rate=2, console_kwargs={"file": io.StringIO(), "width": 200})
    seen = fit(bar, Ramp(1, 5, over=40, unit="samples"))
    realised = expected(seen, unit)
    assert [e["last"] for e in seen.epochs] == [(n, n) for n in realised]
    assert all(not e["passed"] for e in seen.epochs)
    fit_steps = sum(e["steps"] for e in seen.epochs)
    assert seen.fit[-1] == (fit_steps, fit_steps)
    if kind == "tqdm":  # drawn only at multiples of 4 and at the total
        drawn = [n for e in seen.epochs for n in e["drawn"]]
        assert drawn and all(n % 4 == 0 or n in realised for n in drawn)


def test_rich_leave_draws_the_overall_bar_with_each_epoch() -> None:
    """``leave=True``: each epoch's bars stay printed (Lightning starts a new ``rich`` display per epoch); the
    overall bar is drawn in each, with the steps done by then."""
    bar = RichStepProgressBar(leave=True, console_kwargs={"file": io.StringIO(), "width": 200})
    seen = fit(bar, 3)
    assert seen.fit[-1] == (12, 12)
    text = bar.progress.console.file.getvalue()  # type: ignore[union-attr]
    overall = [line.split()[2] for line in text.splitlines() if line.startswith("Steps")]
    assert overall == ["6/12", "12/12"], text


class Clock:
    """The host clock the window engine reads (``time.perf_counter``), moved only by ``Ticks``."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class Ticks(pl.Callback):
    """Moves the clock by a known time per training batch (0.5, 0.75 or 1 s) and per validation (2 s), and keeps
    the reference per optimizer step: the tokens and samples of the window's batches, counted here, and the time
    since the previous window's end."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.tokens = self.samples = 0
        self.seconds = 0.0
        self.windows: list[tuple[int, int, float]] = []

    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.seconds += seconds

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.tick(0.5 + 0.25 * (batch_idx % 3))
        self.tokens += int(count_tokens(batch))
        self.samples += len(batch["x"])

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.tick(2.0)

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
        self.windows.append((self.tokens, self.samples, self.seconds))
        self.tokens = self.samples = 0
        self.seconds = 0.0


class Memory(pl.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


# `accum/tokens_per_second` (and `accum/samples_per_second`) as the loggers get them, once per optimizer step:
# the window's tokens (samples) over the host time since the previous window's end, a validation inside the
# window included; k changes (a ramp over samples), the last window of each epoch is cut short
@pytest.mark.parametrize("mixin", [False, True], ids=["callback", "mixin"])
def test_throughput_is_the_windows_tokens_over_its_time(mixin: bool, monkeypatch: Any) -> None:
    from lightning_accum._core import engine

    clock = Clock()
    monkeypatch.setattr(engine, "time", clock)
    ticks, logger = Ticks(clock), Memory()
    schedule = Ramp(1, 4, over=20, unit="samples")
    kwargs: dict[str, Any] = dict(normalize="items", count=count_tokens, reduction="sum")
    if mixin:
        model: Any = ValidatingMixin(schedule=schedule, **kwargs)
        callbacks: list[Any] = [ticks]
    else:
        model, callbacks = Validating(reduction="sum"), [AccumulationScheduler(schedule, **kwargs), ticks]
    t = trainer(callbacks=callbacks, max_epochs=2, logger=logger, log_every_n_steps=1, val_check_interval=5,
                num_sanity_val_steps=0)  # fmt: skip
    t.fit(model, loader(DATA, 2), loader(TokenData(4), 2))
    assert len(ticks.windows) == 9 + 4  # (k 1, 1, 1, 1, 2, 2, 3, 4, 1 cut; then 4, 4, 4, 4)
    assert any(seconds > 2 for _, _, seconds in ticks.windows)  # (a window holding a validation)
    # each logged step found by the samples seen after it (`accum/samples`)
    after = list(itertools.accumulate(samples for _, samples, _ in ticks.windows))
    logged = {int(row["accum/samples"]): row for row in logger.rows if "accum/tokens_per_second" in row}
    # (the mixin: Lightning's manual loop gives the loggers no step before the first batch's end)
    assert sorted(logged) == (after[1:] if mixin else after)
    for done, (tokens, samples, seconds) in zip(after, ticks.windows, strict=True):
        if done in logged:
            assert logged[done]["accum/tokens_per_second"] == pytest.approx(tokens / seconds, rel=1e-12)
            assert logged[done]["accum/samples_per_second"] == pytest.approx(samples / seconds, rel=1e-12)


# the fit's total as `FitCount` gets it: the windows `estimated_stepping_batches`'s walk forms (counted per epoch
# for `Constant` and epoch-keyed schedules), or `None` past the walk's budget
@pytest.mark.parametrize(
    "schedule",
    [Constant(3), Piecewise({0: 2, 2: 5}, unit="epoch"), Ramp(1, 4, over=3, unit="epoch"),
     Ramp(1, 5, over=40, unit="step"), Ramp(1, 5, over=60, unit="samples")],
    ids=["constant", "piecewise epochs", "ramp epochs", "ramp steps", "ramp samples"],
)  # fmt: skip
@pytest.mark.parametrize("max_epochs, max_steps", [(4, -1), (4, 30), (1, 5), (-1, 23)])
def test_fit_windows_is_the_walk(schedule: Any, max_epochs: int, max_steps: int) -> None:
    from lightning_accum._trainer import steps

    sizes = [2] * 16 + [1]
    walked = steps._walk(schedule, 17, sizes, max_epochs, max_steps)
    assert steps.fit_windows(schedule, 17, sizes, max_epochs, max_steps) == walked


def test_fit_windows_past_the_budget(monkeypatch: Any) -> None:
    from lightning_accum._trainer import steps

    monkeypatch.setattr(steps, "WALK_BUDGET", 50)
    ramp = Ramp(1, 5, over=40, unit="step")
    assert steps.fit_windows(ramp, 17, None, 7, -1) == 46  # (the walk: 14, 22, 28, 33, 38, 42, 46, 50 windows)
    assert steps.fit_windows(ramp, 17, None, 8, -1) is None
    assert steps.fit_windows(ramp, 17, None, 8, 60) is None and steps.fit_windows(ramp, 17, None, 8, 49) == 49
    assert steps.fit_windows(Constant(2), 17, None, 10**9, -1) == 9 * 10**9  # (counted, not walked)
    assert steps.fit_windows(Piecewise({0: 2, 2: 5}, unit="epoch"), 17, None, 40, -1) == 9 * 2 + 4 * 38  # (per epoch)


def test_an_epoch_keyed_walk_counts_at_most_the_budget_in_epochs(monkeypatch: Any) -> None:
    """A schedule keyed on epochs is counted an epoch at a time, each epoch against the budget: ``WALK_BUDGET``
    epochs are counted, one more is past it."""
    from lightning_accum._trainer import steps

    monkeypatch.setattr(steps, "WALK_BUDGET", 40)
    epochs = Piecewise({0: 2, 2: 5}, unit="epoch")  # ceil(17 / 2) = 9 windows in epochs 0 and 1, ceil(17 / 5) = 4 after
    assert steps.fit_windows(epochs, 17, None, 40, -1) == 9 * 2 + 4 * 38
    assert steps.fit_windows(epochs, 17, None, 41, -1) is None
    assert steps.fit_windows(epochs, 17, None, -1, 9 * 2 + 4 * 38) == 9 * 2 + 4 * 38  # (stops at max_steps first)


def test_a_checkpoint_of_the_bar_without_known_is_read_as_known() -> None:
    """(A checkpoint written before the bar's state said whether the epoch's start was known: it was.)"""
    bar = StepProgressBar()
    bar.load_state_dict({"epoch": 0, "first_step": 1, "first_microbatches": 3})
    assert bar.state_dict() == {"epoch": 0, "first_step": 1, "first_microbatches": 3, "known": True}
