"""The one place that leans on Lightning's loop internals.

Lightning 2.x (read off 2.6) steps the optimizer after the batch where
``(batch_idx + 1) % trainer.accumulate_grad_batches == 0`` (or the epoch's last batch), zeroes
gradients before the backward of the batch where ``batch_idx % trainer.accumulate_grad_batches
== 0`` and divides every loss by ``trainer.accumulate_grad_batches``. Setting that attribute
at a window's first batch, to ``lightning_accum.window.lightning_divisor``, makes the loop
close the window exactly where the schedule says. It also reads the loop's batch progress
(which part of a batch had run when an exception came), calls the loop's zero-grad path and
writes the progress bar's metrics.
``tests/test_lightning_seam.py`` fails if Lightning changes any of these.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


def set_divisor(trainer: Any, value: int) -> None:
    """Make Lightning's automatic loop step after ``value``-aligned batches and divide by ``value``."""
    trainer.accumulate_grad_batches = value


def zero_grad_like_lightning(trainer: Any, batch_idx: int, optimizer: Optimizer) -> None:
    """Zero gradients through Lightning's own zeroing path: the ``on_before_zero_grad`` hooks, the
    module's ``optimizer_zero_grad`` (user overrides and ``GradientDecay`` still apply) and the
    loop's zero-grad progress counters."""
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    loop._on_before_zero_grad(optimizer)
    loop._optimizer_zero_grad(batch_idx, optimizer)


def epoch_ends_after_this_batch(trainer: Any) -> bool:
    """Whether the batch being trained is the epoch's last (data exhausted or the batch limit).

    ``trainer.is_last_batch`` comes from the prefetching data fetcher; the batch index, which
    only the epoch loop holds, covers ``limit_train_batches``.
    """
    batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    return bool(trainer.is_last_batch) or batch_idx + 1 >= trainer.num_training_batches


def batch_processed(trainer: Any) -> bool:
    """Whether the batch being trained got past its optimization (Lightning's ``processed``
    counter): after an exception from here on (``on_train_batch_end``), a resumed run does not
    train this batch again; before it, the batch is trained again from its start."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return bool(progress.processed > progress.completed)


def show_in_progress_bar(trainer: Any, name: str, value: float) -> None:
    """Put ``value`` in the progress bar's metrics now, without ``self.log`` (~0.3 ms a call):
    the bar reads the logger connector's dict, which ``self.log(prog_bar=True)`` also fills."""
    trainer._logger_connector._progress_bar_metrics[name] = value


def backward_skipped(trainer: Any) -> bool:
    """Whether Lightning skips backward and the optimizer step for this epoch's batches (what
    ``StochasticWeightAveraging`` does for its BatchNorm-update epoch)."""
    return bool(getattr(trainer.fit_loop, "_skip_backward", False))


class SchedulerFrequencies:
    """Lightning steps a step-interval LR scheduler when ``(batch_idx + 1) % frequency == 0``:
    counted in batches, reset each epoch. Set per optimizer step, this makes ``frequency`` count
    optimizer steps; ``restore`` gives the configs back as the user made them."""

    def __init__(self, trainer: Any = None) -> None:
        configs = [] if trainer is None else trainer.lr_scheduler_configs
        self.saved = [(c, c.frequency) for c in configs if c.interval == "step" and c.frequency > 1]

    def before_step(self, step: int, batch_idx: int) -> None:
        """Optimizer step ``step`` is taken after batch ``batch_idx``."""
        for config, frequency in self.saved:
            config.frequency = 1 if step % frequency == 0 else batch_idx + 2

    def restore(self) -> None:
        for config, frequency in self.saved:
            config.frequency = frequency
        self.saved = []
