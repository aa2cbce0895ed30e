"""The LR schedulers of the mixin's optimizers, stepped as Lightning's automatic loop steps them.

In manual optimization Lightning steps no scheduler: the mixin does, at each window's step for
``interval="step"``, after an epoch's last batch for ``interval="epoch"`` (Lightning's default;
``ReduceLROnPlateau`` at the epoch's end, after ``on_train_epoch_end``),
honouring ``frequency`` (in optimizer steps or epochs) and giving ``ReduceLROnPlateau`` its
``monitor`` from ``trainer.callback_metrics``, as ``_TrainingEpochLoop._update_learning_rates`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

#: ``id(scheduler)`` -> the ``(monitor, strict)`` its config gave (Lightning keeps neither in manual optimization)
Monitors = dict[int, tuple[str | None, bool]]


def step_schedulers(
    module: Any,
    trainer: Any,
    monitors: Monitors,
    interval: str,
    count: int,
    optimizers: Sequence[Optimizer] = (),
    plateau: bool | None = None,
) -> None:
    """Step the schedulers of ``interval`` due at ``count`` (optimizer steps or epochs done, counting this
    one); for ``"step"``, those of ``optimizers`` only; ``plateau``: only (or no) ``ReduceLROnPlateau``."""
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if config.interval != interval or count % config.frequency:
            continue
        if plateau is not None and plateau != isinstance(scheduler, ReduceLROnPlateau):
            continue
        if interval == "step" and getattr(scheduler, "optimizer", None) not in optimizers:
            continue
        metric = None
        if isinstance(scheduler, ReduceLROnPlateau):
            monitor, strict = monitors.get(id(scheduler), (None, True))
            if monitor is None:
                raise ValueError(
                    "A `ReduceLROnPlateau` scheduler needs the metric it watches: return it from "
                    '`configure_optimizers` as `{"scheduler": scheduler, "monitor": "val_loss"}`.'
                )
            metric = trainer.callback_metrics.get(monitor)
            if metric is None:
                if strict:
                    raise RuntimeError(
                        f"`ReduceLROnPlateau` monitors {monitor!r}, which was not logged before its {interval} ended; "
                        f"logged: {sorted(trainer.callback_metrics)}. Log it with `self.log(...)`, or give one of "
                        "these as the scheduler config's `monitor`."
                    )
                continue
        module.lr_scheduler_step(scheduler, metric)
