"""``BarCount``: what the progress bars of ``lightning_accum.progress`` count, one place for both.

The training bar counts optimizer steps (the windows that stepped, from the ``on_window_end`` reports) or
loader batches, with the epoch's total from the schedule: the windows ``steps.windows_ahead`` walks from
where the epoch stands (exact for schedules keyed on epochs and steps, and on samples where the loader says
each batch's size), capped by the steps ``max_steps`` leaves. For the other schedules (items, ``Lambda``,
``NoiseScale``, samples of a loader that does not say) the total is worked out again at each window's end
from the k the next window will have (a ``Budget`` of items: the mean micro-batches of the windows so far), so
that the counter never passes it and meets it at the epoch's end.
Host arithmetic only: nothing here reads a device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from lightning_accum._trainer import steps
from lightning_accum._trainer.reporting import WindowReport
from lightning_accum.noise import NoiseScale
from lightning_accum.schedules import Budget, Progress

Unit = Literal["steps", "batches"]
UNITS: tuple[str, ...] = ("steps", "batches")


def check_unit(unit: object, owner: str) -> Unit:
    """``unit``, or an error that names the argument and what it takes."""
    if not isinstance(unit, str):
        raise TypeError(f"`{owner}(unit=...)` takes 'steps' or 'batches' (a string); got {unit!r}.")
    if unit not in UNITS:
        near = {"step": "steps", "optimizer_steps": "steps", "batch": "batches", "microbatches": "batches"}
        hint = f" Did you mean {near[unit.lower()]!r}?" if unit.lower() in near else ""
        hint = hint or (f" Did you mean {unit.lower()!r}?" if unit.lower() in UNITS else "")
        raise ValueError(
            f"`{owner}(unit=...)` takes 'steps' (the bar counts optimizer steps) or 'batches' (loader batches, "
            f"Lightning's counter, with the total the schedule gives); got {unit!r}.{hint}"
        )
    return "steps" if unit == "steps" else "batches"


class BarCount:
    """The training bar's counter and total, the last window's numbers and the throughput; its
    ``state_dict`` holds where the epoch began (so that a fit resumed inside it shows its position).

    Example:

        >>> count = BarCount("steps")
        >>> count.state_dict()
        {'epoch': -1, 'first_step': 0, 'first_microbatches': 0, 'known': True}
    """

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        # where the epoch began (`Progress.step`, `Progress.microbatches`): its steps are counted from there
        self._epoch, self._first_step, self._first_microbatches = -1, 0, 0
        self._loaded = False  # a checkpoint gave the above
        self._fresh = True  # the epoch's start was taken at its start, not from a checkpoint
        self._known = True  # whether the epoch's start is known (not: resumed from a checkpoint without the bar's)
        self._known_loaded = True  # what a checkpoint said of it
        self._accumulating: steps.Accumulating | None = None
        self._counted = False  # the fit counts items (`count=`): read once, at the fit's start
        self._budget = False  # the schedule is a `Budget` (its windows' k is what they took)
        self._world = 1  # the ranks (the trainer's, read once at the fit's start)
        self._exact = False  # whether the walk is exact for this fit's schedule
        self._sizes: list[int] | None = None
        self._batches: int | float = math.inf  # the epoch's batches (inf: an iterable loader)
        self.last_batch = -1  # the batch under way, in the epoch
        #: whether this fit's epoch under way was started (Lightning skips `on_train_epoch_start` for an epoch
        #: resumed inside it)
        self.started = False
        #: the optimizer steps taken in this epoch (known since the epoch's start)
        self.steps = 0
        #: the training bar's total (inf: unbounded, shown as '?')
        self.total: float = math.inf
        #: the last stepped window, and the micro-batches it took (each rank's)
        self.last: WindowReport | None = None
        self.taken = 0
        #: samples (or items, with a ``count``) per second over the last window (``WindowReport.seconds``)
        self.rate: float | None = None

    @property
    def counted(self) -> bool:
        """Whether the fit counts items (``count=``): the postfix then shows tokens."""
        return self._counted

    def start_fit(self, trainer: Any, owner: str) -> None:
        """At train start (after a checkpoint is restored): find the fit's accumulation, or refuse."""
        found = steps.accumulating(trainer)
        if found is None:
            raise RuntimeError(
                f"{owner} counts the windows of an `AccumulationScheduler` or an `AccumulationMixin` model, and this "
                f"fit has neither. Add `AccumulationScheduler(...)` to `Trainer(callbacks=...)` (or configure the "
                "mixin), or use Lightning's own progress bar."
            )
        self._accumulating = found
        self._counted, self._budget = bool(found.counted), isinstance(found.schedule, Budget)
        self._world = max(int(getattr(trainer, "world_size", 1) or 1), 1)
        if not self._loaded:  # (a fit not resumed from a checkpoint of this bar)
            self._epoch, self._known_loaded = -1, True
        self._loaded = False
        self.last, self.rate, self.started = None, None, False

    def start_epoch(self, trainer: Any) -> None:
        """At an epoch's start: where it begins and its total."""
        assert self._accumulating is not None
        progress = self._accumulating.progress()
        epoch = int(trainer.current_epoch)
        # a new epoch (a fit resumed inside this one has its start from the checkpoint)
        self._fresh = epoch != self._epoch
        if self._fresh:
            self._epoch, self._first_step, self._first_microbatches = epoch, progress.step, progress.microbatches
        self._known = self._fresh or self._known_loaded
        self.started = True
        self.last_batch = -1
        batches = trainer.num_training_batches
        self._batches = batches if math.isinf(batches) else int(batches)
        schedule = self._accumulating.schedule
        unit = getattr(schedule, "unit", None)
        self._sizes = None
        if not math.isinf(self._batches) and unit == "samples":
            self._sizes = steps.samples_per_batch(trainer, int(self._batches))
        self._exact = steps.walk_is_exact(schedule, self._sizes)
        self.steps = progress.step - self._first_step
        self.total = self._total(trainer, progress, None) if self._known else math.inf  # (unknown: at the batch)

    def batch_start(self, trainer: Any, batch_idx: int) -> bool:
        """At a training batch's start; whether the total changed: a fit resumed inside an epoch from a checkpoint
        without this bar's state does not know the epoch's earlier windows, so its steps are counted from here and
        its total found as the epoch goes."""
        first, self.last_batch = self.last_batch < 0, batch_idx
        if not (first and batch_idx > 0 and (self._fresh or not self._known)):
            return False
        progress = self._progress()
        if self._fresh:  # (else a checkpoint's count, itself from a resume without the bar's state, goes on)
            self._first_step, self.steps = progress.step, 0
        self._known, self._fresh = False, False
        total = self._total(trainer, progress, batch_idx)
        changed, self.total = total != self.total, total
        return changed

    def window_end(self, trainer: Any, window: WindowReport) -> bool:
        """A window stepped: count it, its throughput; whether the total changed."""
        self.last, self.taken = window, self._taken(window)
        done = window.items if self._counted else window.samples
        self.rate = done / window.seconds if window.seconds else None
        self.steps += 1
        if self._exact and self._known:
            return False
        total = self._total(trainer, window.progress, self.last_batch + 1)
        changed, self.total = total != self.total, total
        return changed

    def _taken(self, window: WindowReport) -> int:
        """The micro-batches ``window`` took, each rank's: a ``Budget``'s ``k`` is that already; a schedule's ``k`` is
        what it gave the window, which holds fewer where it was cut short at the epoch's end (or some of its batches
        ran no backward): its micro-batches over all ranks, per rank."""
        if self._budget:
            return window.k
        return min(window.k, -(-window.microbatches // self._world))

    def _progress(self) -> Progress:
        assert self._accumulating is not None
        return self._accumulating.progress()

    def _total(self, trainer: Any, progress: Progress, start: int | None) -> float:
        """The epoch's total from ``progress`` (after the last closed window), the next window opening at batch
        ``start`` of the epoch (``None``: where the closed windows leave it): walked exactly where the walk knows the
        schedule's windows (``_walked``), else estimated from the next window's k (``_estimated``)."""
        if start is None:
            start = progress.microbatches - self._first_microbatches
        done = self.steps if self.unit == "steps" else start
        left = math.inf if trainer.max_steps < 0 else max(int(trainer.max_steps) - int(trainer.global_step), 0)
        if not self._known and self.unit == "steps" and self.last is None:
            return math.inf
        here = dataclasses.replace(progress, epoch=self._epoch)
        if self._exact and self._known:
            walked = self._walked(here, start, left)
            if walked is not None:
                return done + walked
        return done + self._estimated(progress, here, start, left)

    def _walked(self, here: Progress, start: int, left: float) -> float | None:
        """The steps (or batches) the epoch's windows from batch ``start`` take, at most ``left`` steps, walked as the
        package forms them; ``None`` (and estimated from then on) where the schedule reads the items a ``count``
        gives, which the walk does not know."""
        assert self._accumulating is not None
        if math.isinf(self._batches) and math.isinf(left):
            return math.inf
        try:
            ahead, taken = steps.windows_ahead(
                self._accumulating.schedule, here, start, self._batches, self._sizes, left, items_known=not self.counted
            )
        except steps.ItemsNotKnown:  # (a function of `Progress` reading the items a `count` gives: estimated)
            self._exact = False
            return None
        return ahead if self.unit == "steps" else taken

    def _estimated(self, progress: Progress, here: Progress, start: int, left: float) -> float:
        """The steps (or batches) left in the epoch from batch ``start``, at most ``left`` steps, estimated from the
        next window's k: the schedule's as the engine will ask it (``NoiseScale``: the last window's; a ``Budget``: the
        windows' mean size so far, at most its cap)."""
        assert self._accumulating is not None
        schedule = self._accumulating.schedule
        last = self.last.k if self.last is not None else 1
        if isinstance(schedule, Budget):  # the windows' mean size so far (the counts seen), at most the cap
            k = min(max(round(progress.microbatches / progress.step), 1) if progress.step else 1, schedule(here))
        else:
            k = last if isinstance(schedule, NoiseScale) else schedule(here)
        remaining = self._batches - start
        if self.unit == "steps":
            windows: float = math.ceil(remaining / k) if not math.isinf(remaining) else math.inf
            return min(windows, left)
        return min(remaining, left * k if not math.isinf(left) else math.inf)

    def postfix(
        self, metrics: dict[str, Any], text: bool = False, first: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The bar's postfix: ``first``, then Lightning's ``metrics`` (without the package's own ``accum/k`` and
        ``accum/loss``), then the last window's k, effective batch (samples; tokens too with a ``count``), loss and
        throughput (``text``: the counts as strings, which a bar draws as they are, without formatting them as
        numbers).

        Example:

            >>> BarCount("steps").postfix({"accum/k": 4.0, "v_num": 0}, first={"step": "0/?"})
            {'step': '0/?', 'v_num': 0}
        """
        out = {} if first is None else dict(first)
        out.update(metrics)
        out.pop("accum/k", None)
        out.pop("accum/loss", None)
        window = self.last
        if window is None:
            return out
        shown = str if text else int
        out["k"] = shown(self.taken)
        out["batch"] = shown(window.samples)
        if self._counted:
            out["tokens"] = shown(window.items)
        if window.loss is not None:
            out["loss"] = window.loss
        if self.rate is not None:
            out["tokens/s" if self._counted else "samples/s"] = shown(round(self.rate))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch, "first_step": self._first_step, "first_microbatches": self._first_microbatches,
            "known": self._known,  # (False: the steps are counted from a resume, the epoch's start unknown)
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state.get("epoch", -1))
        self._first_step = int(state.get("first_step", 0))
        self._first_microbatches = int(state.get("first_microbatches", 0))
        self._known_loaded = bool(state.get("known", True))
        self._loaded = True
