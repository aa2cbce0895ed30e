"""Progress bars that count what training counts: optimizer steps, with the epoch's true total.

Lightning's bars count loader batches. Under accumulation the number planned with is optimizer steps, and
with ``max_steps`` and an iterable loader Lightning's total is in steps while its counter runs in batches
(Lightning issue #20124). Only the accumulation schedule knows how many windows an epoch holds: these bars
ask it. Drop-in for Lightning's: ``Trainer(callbacks=[AccumulationScheduler(...), StepProgressBar()])``.

Example:

    >>> from lightning_accum.progress import StepProgressBar
    >>> bar = StepProgressBar(unit="steps", refresh_rate=10)
    >>> bar.unit
    'steps'
"""

from __future__ import annotations

import importlib.util
import numbers
from typing import Any

from typing_extensions import override

from lightning_accum._lightning import pl
from lightning_accum._trainer import steps
from lightning_accum._trainer.bar_count import BarCount, Unit, check_unit
from lightning_accum._trainer.fit_count import FitCount
from lightning_accum._trainer.reporting import WindowReport, reads_counts_only

__all__ = ["RichStepProgressBar", "StepProgressBar"]


def _check_refresh_rate(refresh_rate: object, owner: str, per: str) -> int:
    """``refresh_rate``, or an error that names the argument and what it takes."""
    what = (
        f"`{owner}(refresh_rate=...)` takes how often the bar is drawn, an integer >= 0 ({per}; 0 hides it, as "
        f"`Trainer(enable_progress_bar=False)` does); got {refresh_rate!r}."
    )
    if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, numbers.Integral):
        raise TypeError(what)
    if refresh_rate < 0:
        raise ValueError(what)
    return int(refresh_rate)


class _StepBar(pl.callbacks.ProgressBar):
    """The hooks both bars share over a ``BarCount`` (``self._count``, the training bar) and a ``FitCount``
    (``self._fit``, the fit's steps); each bar draws its totals."""

    _count: BarCount
    _fit: FitCount
    _shown: int  # the batch whose end the bar has shown (its window may end after, in another callback)
    # the counts as strings, drawn as they are (Rich formats every number as a float; tqdm formats each number,
    # through Lightning's padding, at every refresh)
    _counts_as_text = True
    _fit_in_postfix = False  # the fit's steps shown first in the postfix (TQDM's; Rich draws an overall bar)

    @property
    def unit(self) -> Unit:
        """What the training bar counts: ``"steps"`` or ``"batches"``."""
        return self._count.unit

    @property
    @override
    def total_train_batches(self) -> int | float:
        """The training bar's total this epoch, in ``unit`` (``inf``: unbounded)."""
        return self._count.total

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count.start_fit(trainer, type(self).__name__)
        found = steps.accumulating(trainer)
        assert found is not None  # (refused above)
        self._fit.start_fit(trainer, found)
        super().on_train_start(trainer, pl_module)
        self._show_fit()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count.start_epoch(trainer)
        super().on_train_epoch_start(trainer, pl_module)
        self._show_fit()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._count.started:  # an epoch resumed inside it (Lightning calls no `on_train_epoch_start`)
            self._count.start_epoch(trainer)
            self._count.batch_start(trainer, batch_idx)
            self._resume_bar(trainer, self._count.steps if self._count.unit == "steps" else batch_idx)
            return
        if self._count.batch_start(trainer, batch_idx):
            self._set_total()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._count.unit == "batches":
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self._shown = batch_idx

    @reads_counts_only
    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: WindowReport) -> None:
        """A window stepped: the training bar counts it (``unit="steps"``) and shows its numbers."""
        self._fit.window_end(window)
        self._show_fit()
        if self._count.window_end(trainer, window):
            self._set_total()
        if self._count.unit == "steps":
            super().on_train_batch_end(trainer, pl_module, None, None, self._count.steps - 1)
        elif self._shown == self._count.last_batch:  # (the batch's end was shown before the window ended)
            super().on_train_batch_end(trainer, pl_module, None, None, self._shown)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The postfix: the fit's steps (``step``, ``done/total``; TQDM's), Lightning's metrics, then the last
        window's ``k``, ``batch``, ``tokens``, ``loss`` and throughput."""
        first = {"step": self._fit.text()} if self._fit_in_postfix else None
        return self._count.postfix(super().get_metrics(trainer, pl_module), self._counts_as_text, first)

    def _set_total(self) -> None:
        """Draw the changed total (the bar's own)."""

    def _show_fit(self) -> None:
        """Draw the fit's steps where the bar draws them on its own (Rich's overall bar; TQDM's postfix is drawn
        with the training bar's refresh)."""

    def _resume_bar(self, trainer: pl.Trainer, done: int) -> None:
        """Draw the training bar of an epoch resumed inside it: its total, ``done`` of it (the bar's own)."""

    @override
    def state_dict(self) -> dict[str, Any]:
        """Where the epoch began, so that a fit resumed inside it counts its steps from there."""
        return self._count.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._count.load_state_dict(state_dict)


class StepProgressBar(_StepBar, pl.callbacks.TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` whose training bar counts optimizer steps under the fit's accumulation
    schedule (``AccumulationScheduler`` or ``AccumulationMixin``; a fit with neither is refused at its start).

    * ``unit="steps"``: the counter advances once per window that stepped (a window of no items does not count);
      the total is the windows the schedule closes in this epoch (for a sized loader: exact for schedules keyed on
      epochs and steps, and on samples where the loader's batch sampler gives each batch's size; for schedules
      keyed on items, ``Lambda``, ``NoiseScale``, it is worked out again at each window's end from the next
      window's k, so the counter never passes it), capped by the steps ``max_steps`` leaves; for an iterable
      loader ``max_steps - global_step``, or ``?`` when nothing bounds it.
    * ``unit="batches"``: Lightning's batch counter, with the total the schedule gives (the batches the steps left
      take: an iterable loader with ``max_steps`` gets the sum of their k).

    The postfix shows first the fit's optimizer steps, done and total (``step=12/40``: the steps of the whole fit
    from its start, capped by ``max_steps``, where the schedule's walk knows them as for the training bar's total
    and the loader has a length; else ``max_steps``, or ``?`` without it; a resumed fit counts the steps before
    its checkpoint), then the last window's ``k``, its effective batch (``batch``, samples over all ranks;
    ``tokens`` too where a ``count`` is given), its ``loss`` (where the losses are read: ``log=True``) and the
    throughput (``samples/s``, or ``tokens/s`` with a ``count``: the window's count over the host time since
    the previous window ended, ``WindowReport.seconds``). A fit resumed inside an epoch (or a window) shows its
    position and total as the uninterrupted one did (with a checkpoint written by a fit with this bar; without,
    the steps are counted from the resume). Validation bars are Lightning's. Nothing is read from a device: the
    numbers are the window reports' (``on_window_end``), which the accumulation reads once per window anyway,
    and no gradient norm is measured for the bar. With the mixin, the steps are windows (one per window shared
    by several optimizers; ``max_steps`` is taken as counting windows).

    Args:
        unit: ``"steps"`` (optimizer steps) or ``"batches"`` (loader batches).
        refresh_rate: as Lightning's ``TQDMProgressBar``: the bar is drawn every ``refresh_rate`` counts (steps
            under ``unit="steps"``) and at the total; 0 hides it. An integer >= 0.
        process_position: as Lightning's ``TQDMProgressBar``.
        leave: as Lightning's ``TQDMProgressBar``.

    Example:

        >>> import lightning.pytorch as pl
        >>> from lightning_accum import AccumulationScheduler, Ramp
        >>> from lightning_accum.progress import StepProgressBar
        >>> ramp = Ramp(1, 8, over=10_000, unit="samples")
        >>> trainer = pl.Trainer(callbacks=[AccumulationScheduler(ramp), StepProgressBar()], logger=False)
    """

    _fit_in_postfix = True

    def __init__(
        self, unit: Unit = "steps", refresh_rate: int = 1, process_position: int = 0, leave: bool = False
    ) -> None:
        count = BarCount(check_unit(unit, type(self).__name__))
        rate = _check_refresh_rate(refresh_rate, type(self).__name__, "counts between draws")
        super().__init__(refresh_rate=rate, process_position=process_position, leave=leave)
        self._count, self._fit = count, FitCount()
        self._shown = -1  # the batch whose end this bar has shown (its window may end after, in another callback)

    @override
    def _set_total(self) -> None:
        bar = self._train_bar()
        if bar is not None:
            bar.total = pl.callbacks.progress.tqdm_progress.convert_inf(self._count.total)
            bar.refresh()

    @override
    def _resume_bar(self, trainer: pl.Trainer, done: int) -> None:
        bar = self._train_bar()
        if bar is not None:
            bar.reset(total=pl.callbacks.progress.tqdm_progress.convert_inf(self._count.total))
            bar.initial = 0
            bar.set_description(f"Epoch {trainer.current_epoch}")
            bar.n = done
            bar.refresh()

    def _train_bar(self) -> Any:
        try:
            bar = self.train_progress_bar
        except TypeError:  # (before the fit's training bar exists)
            return None
        return None if bar is None or bar.disable else bar


class RichStepProgressBar(_StepBar, pl.callbacks.RichProgressBar):
    """Lightning's ``RichProgressBar`` counting as ``StepProgressBar`` does (the same counter and total, the same
    postfix), with an overall bar above the epoch's: ``Steps``, the fit's optimizer steps done of its total (the
    total of ``StepProgressBar``'s ``step=``; ``--`` and a pulsing bar where unbounded), with its elapsed time,
    the time left and the steps per second (with ``leave=True`` each epoch's display draws it again, below the
    epoch's bar from the second epoch on, its times from that epoch's start). Needs ``rich``
    (``pip install rich``): refused at construction without it.

    Args:
        unit: ``"steps"`` (optimizer steps) or ``"batches"`` (loader batches).
        refresh_rate: as Lightning's ``RichProgressBar``: draws per second, 0 hides the bars. An integer >= 0.
        leave: as Lightning's ``RichProgressBar``.
        **kwargs: Lightning's ``RichProgressBar``'s others (``theme``, ``console_kwargs``).

    Example:

        >>> from lightning_accum.progress import RichStepProgressBar
        >>> bar = RichStepProgressBar(unit="batches")
        >>> bar.unit
        'batches'
    """

    #: the overall bar's description
    FIT_DESCRIPTION = "Steps"

    def __init__(self, unit: Unit = "steps", refresh_rate: int = 100, leave: bool = False, **kwargs: Any) -> None:
        count = BarCount(check_unit(unit, type(self).__name__))
        rate = _check_refresh_rate(refresh_rate, type(self).__name__, "draws per second")
        if importlib.util.find_spec("rich") is None:
            raise ModuleNotFoundError(
                "`RichStepProgressBar` draws with `rich`, which is not installed: `pip install rich`, or use "
                "`StepProgressBar` (tqdm)."
            )
        super().__init__(refresh_rate=rate, leave=leave, **kwargs)
        self._count, self._fit = count, FitCount()
        self._shown = -1
        self.fit_progress_bar_id: Any = None  # the overall bar's task in `self.progress`
        self._fit_drawn_in: Any = None  # (the `rich` progress it was added to: a new one, with `leave`, gets it again)

    @property
    def fit_progress_bar(self) -> Any:
        """The overall bar's ``rich`` task: ``completed`` the fit's optimizer steps, ``total`` its total (``inf``:
        unbounded); ``None`` while no bar is drawn."""
        if self.progress is None or self.fit_progress_bar_id is None or self._fit_drawn_in is not self.progress:
            return None
        return self.progress.tasks[self.fit_progress_bar_id]

    @override
    def _show_fit(self) -> None:
        if self.progress is None or self.is_disabled:
            return
        total, done = self._fit.total, self._fit.done
        if self.fit_progress_bar_id is None or self._fit_drawn_in is not self.progress:
            self.fit_progress_bar_id = self.progress.add_task(self.FIT_DESCRIPTION, total=total, completed=done)
            self._fit_drawn_in = self.progress
        else:
            self.progress.update(self.fit_progress_bar_id, total=total, completed=done)

    @override
    def _set_total(self) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=self._count.total)

    @override
    def _resume_bar(self, trainer: pl.Trainer, done: int) -> None:
        if self.progress is None or self.is_disabled:
            return
        description = f"Epoch {trainer.current_epoch}"
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self.progress.add_task(description, total=self._count.total)
        self.progress.update(self.train_progress_bar_id, total=self._count.total, completed=done)
        self.refresh()
