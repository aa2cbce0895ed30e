"""``FitCount``: the progress bars' overall figure, the fit's optimizer steps done and the steps it will take.

Done: ``Progress.step`` (the windows that stepped since the fit began, those before a checkpoint included), read
at the fit's start and from each window's report. Total: for a schedule whose windows the walk knows
(``steps.walk_is_exact``: ``Constant``, epochs, steps, samples of a loader that says its batch sizes) and a sized
loader, the windows of the whole fit from its start (``estimated_stepping_batches``'s walk, once, at the fit's
start; at most ``steps.WALK_BUDGET`` windows, counted per epoch for ``Constant`` and epoch-keyed schedules),
capped by ``max_steps``; otherwise ``max_steps``, or unbounded (``inf``, drawn ``?``) without it. Host arithmetic
only: nothing here reads a device.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_accum._trainer import steps
from lightning_accum._trainer.reporting import WindowReport


class FitCount:
    """The fit's optimizer steps done and its total (``inf``: unbounded).

    Example:

        >>> count = FitCount()
        >>> count.text()
        '0/?'
    """

    def __init__(self) -> None:
        #: the optimizer steps (windows that stepped) since the fit began
        self.done = 0
        #: the steps the whole fit takes (inf: not bounded, or not known in advance)
        self.total: float = math.inf

    def start_fit(self, trainer: Any, accumulating: steps.Accumulating) -> None:
        """At the fit's start (after a checkpoint is restored, the training loader set up): the steps done, and
        the fit's total."""
        self.done = accumulating.progress().step
        max_steps, max_epochs = int(trainer.max_steps), int(trainer.max_epochs)
        bound = math.inf if max_steps < 0 else max_steps
        batches = trainer.num_training_batches
        if math.isinf(batches) or (max_epochs == -1 and max_steps < 0):
            self.total = bound
            return
        sizes = steps.samples_per_batch(trainer, int(batches))
        if not steps.walk_is_exact(accumulating.schedule, sizes):
            self.total = bound
            return
        try:
            walked = steps.fit_windows(
                accumulating.schedule, int(batches), sizes, max_epochs, max_steps, items_known=not accumulating.counted
            )
        except steps.ItemsNotKnown:  # (a function of `Progress` reading the items a `count` gives)
            walked = None
        self.total = bound if walked is None else walked  # (None: longer than the walk's budget, or not known)

    def window_end(self, window: WindowReport) -> None:
        """A window stepped."""
        self.done = window.progress.step

    def text(self) -> str:
        """``"done/total"``, ``?`` for an unbounded total."""
        return f"{self.done}/{'?' if math.isinf(self.total) else int(self.total)}"
