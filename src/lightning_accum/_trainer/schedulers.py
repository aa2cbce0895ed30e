"""The LR schedulers of a mixin model: who steps them, and when.

``configure_accumulation(step_schedulers=...)`` decides:

- ``None`` (the default) or ``False``: Lightning's manual-optimization contract. The model steps its
  schedulers itself (``self.lr_schedulers().step()``, e.g. in its ``on_window_end`` for one step per
  optimizer step, or in ``on_train_epoch_end``); the mixin steps none, and a model written for
  Lightning trains as it does there. ``None`` warns at the fit's start when the fit has schedulers
  (the mixin of 0.1 stepped step-interval schedulers itself); ``False`` says the model steps them.
- ``True``: the mixin steps them as Lightning's automatic loop does (``_TrainingEpochLoop.
  _update_learning_rates``): ``interval="step"`` at each window's step (``frequency`` in the window's
  optimizer steps, where Lightning counts the epoch's batches), ``interval="epoch"`` after an epoch's
  last batch, ``ReduceLROnPlateau`` (or a config's ``reduce_on_plateau=True``) with the ``monitor``
  and ``strict`` its config names, read from ``trainer.callback_metrics`` where Lightning's loop
  steps it (``interval="step"``: after the batch's ``on_train_batch_end`` and its validation;
  ``"epoch"``: after the LightningModule's ``on_train_epoch_end``). The configurations that loop
  refuses are refused at the fit's start, and a step the model takes itself is refused at the next
  hook, before any optimizer step uses it (a silent double step otherwise).

Handed the trainer's scheduler configs, it imports nothing of Lightning but ``rank_zero_warn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau

from lightning_accum._lightning import rank_zero_warn

INTERVALS = ("step", "epoch")
#: where a plateau scheduler of each interval is stepped, as Lightning's automatic loop steps it
WHEN = {
    "step": "after the batch's `on_train_batch_end` hooks and its validation, if one runs",
    "epoch": "after the LightningModule's `on_train_epoch_end`",
}


@dataclasses.dataclass(frozen=True)
class Keys:
    """What a scheduler config of ``configure_optimizers`` said that Lightning drops in manual optimization."""

    monitor: str | None = None
    strict: bool = True
    plateau: bool | None = None  # the config's `reduce_on_plateau`, where given


#: ``id(scheduler)`` -> ``(monitor, strict, reduce_on_plateau or None)``, as ``_seam.keep_scheduler_keys`` finds them
Kept = dict[int, tuple[str | None, bool, bool | None]]


class MixinSchedulers:
    """The fit's LR schedulers as the mixin sees them: the keys Lightning drops, their steps under
    ``step_schedulers=True``, and the watch for a step the model takes itself then.

    Example:

        >>> schedulers = MixinSchedulers()
        >>> schedulers.kept
        {}
    """

    def __init__(self) -> None:
        self.kept: Kept = {}
        self._seen: dict[int, tuple[Any, int]] = {}  # id(scheduler) -> (it, `last_epoch` after the mixin's step)
        # the step-interval plateau steps of this batch's windows, due where Lightning's loop steps them
        self._due: list[tuple[int, tuple[Optimizer, ...]]] = []

    # ------------------------------------------------------------------ the fit's start
    def check_fit(self, configs: Sequence[Any], module: Any, mode: bool | None, custom_step: bool) -> None:
        """At the fit's start: under ``True``, refuse what Lightning's automatic loop refuses (``custom_step``:
        the module overrides ``lr_scheduler_step``); under ``None``, say who steps the schedulers."""
        if not configs:
            return
        name = type(module).__name__
        if mode is None:
            listed = ", ".join(type(c.scheduler).__name__ for c in configs)
            rank_zero_warn(
                f"`{name}` has LR schedulers ({listed}) and uses `AccumulationMixin`, which leaves them to the model "
                "as Lightning's manual optimization does: step them yourself (in the model's "
                "`on_window_end(self, window)` for one step per optimizer step), or have the mixin step them as "
                "Lightning's automatic loop would with `configure_accumulation(..., step_schedulers=True)`. "
                "`step_schedulers=False` says you step them (and silences this)."
            )
            return
        if not mode:
            return
        for config in configs:
            self._check_config(config, name, custom_step)

    def _check_config(self, config: Any, name: str, custom_step: bool) -> None:
        scheduler, kind = config.scheduler, type(config.scheduler).__name__
        fix = f"(`{name}.configure_optimizers`, with `configure_accumulation(step_schedulers=True)`)"
        if config.interval not in INTERVALS:
            raise ValueError(
                f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is "{config.interval}" {fix}: '
                'give `"interval": "step"` (one step per window) or `"epoch"`.'
            )
        frequency = config.frequency
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f'The "frequency" of the {kind} scheduler must be an integer >= 1 (the {config.interval}s between '
                f'its steps) but is {frequency!r} {fix}: give `"frequency": 1` (or leave it out) for every '
                f"{config.interval}."
            )
        if self.is_plateau(config) and self.keys(scheduler).monitor is None:
            raise ValueError(
                "The lr scheduler dict must include a monitor when a `ReduceLROnPlateau` scheduler is used "
                f'{fix}. For example: {{"optimizer": optimizer, "lr_scheduler": {{"scheduler": scheduler, '
                '"monitor": "your_loss"}}.'
            )
        if not isinstance(scheduler, LRScheduler | ReduceLROnPlateau) and not custom_step:
            raise TypeError(
                f"The provided lr scheduler `{kind}` doesn't follow PyTorch's LRScheduler API {fix}. You should "
                "override the `LightningModule.lr_scheduler_step` hook with your own logic if you are using a custom "
                "LR scheduler, or step it yourself with `step_schedulers=False`."
            )
        if isinstance(scheduler, OneCycleLR) and config.interval == "epoch":
            rank_zero_warn(
                "A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't mean "
                "'interval': 'step'?"
            )

    # ------------------------------------------------------------------ the model's own steps
    def watch(self, configs: Sequence[Any]) -> None:
        """At the training's start (the checkpoint restored): where each scheduler stands now."""
        self._seen = {}
        self.check_untouched(configs)

    def check_untouched(self, configs: Sequence[Any]) -> None:
        """Refuse a scheduler stepped since the mixin last stepped it (or since ``watch``): the model's own
        ``scheduler.step()`` under ``step_schedulers=True``. A scheduler not seen before is taken as it stands
        (``StochasticWeightAveraging`` swaps in its own)."""
        for config in configs:
            scheduler = config.scheduler
            now = getattr(scheduler, "last_epoch", None)
            if not isinstance(now, int):
                continue  # (a scheduler without a step count cannot be watched)
            seen = self._seen.get(id(scheduler))
            if seen is None or seen[0] is not scheduler:
                self._seen[id(scheduler)] = scheduler, now
            elif seen[1] != now:
                when = "after each epoch" if config.interval == "epoch" else "at each window's step"
                raise RuntimeError(
                    f"The LR scheduler `{type(scheduler).__name__}` was stepped by the model (its `last_epoch` went "
                    f"from {seen[1]} to {now}), but with `configure_accumulation(step_schedulers=True)` the mixin "
                    f'steps the fit\'s LR schedulers itself (this one, of "interval": "{config.interval}", {when}), '
                    "so it would be stepped twice. Remove the model's `scheduler.step()` "
                    "(`self.lr_schedulers().step()`), or drop `step_schedulers=True` to step them yourself as in "
                    "Lightning's manual optimization."
                )

    # ------------------------------------------------------------------ the mixin's steps
    def fresh(self) -> Kept:
        """At a fit's setup: forget the last fit's configs; the dict to catch this fit's keys in."""
        self.kept = {}
        return self.kept

    def defer_plateau(self, count: int, optimizers: Sequence[Optimizer]) -> None:
        """A window of ``optimizers`` stepped (``count``: its group's optimizer steps): its step-interval plateau
        schedulers are due at the batch's plateau point (``step_due``), after ``on_train_batch_end`` and the
        batch's validation, where Lightning's automatic loop steps them, so that a metric logged there is fresh."""
        self._due.append((count, tuple(optimizers)))

    def step_due(self, module: Any, trainer: Any) -> None:
        """At the batch's plateau point: the step-interval plateau steps its windows made due."""
        due, self._due = self._due, []
        for count, optimizers in due:
            self.step(module, trainer, "step", count, optimizers, plateau=True)

    def drop_due(self) -> None:
        """The batch did not reach its plateau point (an exception): Lightning's loop steps nothing then."""
        self._due = []

    def keys(self, scheduler: Any) -> Keys:
        found = self.kept.get(id(scheduler))
        return Keys() if found is None else Keys(*found)

    def is_plateau(self, config: Any) -> bool:
        plateau = self.keys(config.scheduler).plateau
        return isinstance(config.scheduler, ReduceLROnPlateau) if plateau is None else plateau

    def step(
        self,
        module: Any,
        trainer: Any,
        interval: str,
        count: int,
        optimizers: Sequence[Optimizer] = (),
        plateau: bool | None = None,
    ) -> None:
        """Step the schedulers of ``interval`` due at ``count`` (optimizer steps or epochs done, counting this
        one); for ``"step"``, those of ``optimizers`` only; ``plateau``: only (or no) plateau schedulers."""
        configs = trainer.lr_scheduler_configs
        self.check_untouched(configs)
        for config in configs:
            scheduler = config.scheduler
            if config.interval != interval or count % config.frequency:
                continue
            if plateau is not None and plateau != self.is_plateau(config):
                continue
            if interval == "step" and getattr(scheduler, "optimizer", None) not in optimizers:
                continue
            metric = None
            if self.is_plateau(config):
                keys = self.keys(scheduler)
                assert keys.monitor is not None  # (refused at the fit's start)
                metric = trainer.callback_metrics.get(keys.monitor)
                if metric is None:
                    when = WHEN[interval]
                    if keys.strict:
                        raise RuntimeError(
                            f"`{type(scheduler).__name__}` monitors {keys.monitor!r}, which is not in "
                            f"`trainer.callback_metrics` where it is stepped ({when}, as in Lightning's automatic "
                            f"loop); logged: {sorted(trainer.callback_metrics)}. Log it with `self.log(...)` before "
                            'then, give one of these as the scheduler config\'s `monitor`, or `"strict": False` to '
                            "skip the step while it is missing."
                        )
                    rank_zero_warn(
                        f"`{type(scheduler).__name__}` monitors {keys.monitor!r}, which is not in "
                        f"`trainer.callback_metrics` where it is stepped ({when}), and its config says "
                        '`"strict": False`: the step is skipped.',
                        category=RuntimeWarning,
                    )
                    continue
            module.lr_scheduler_step(scheduler, metric)
        for config in configs:
            now = getattr(config.scheduler, "last_epoch", None)
            if isinstance(now, int):
                self._seen[id(config.scheduler)] = config.scheduler, now
