"""The one place that leans on Lightning's loop internals.

Lightning 2.x (read off 2.6) steps the optimizer after the batch where
``(batch_idx + 1) % trainer.accumulate_grad_batches == 0`` (or the epoch's last batch), zeroes
gradients before the backward of the batch where ``batch_idx % trainer.accumulate_grad_batches
== 0`` and divides every loss by ``trainer.accumulate_grad_batches``. Setting that attribute
at a window's first batch, to :func:`lightning_accum.window.lightning_divisor`, makes the loop
close the window exactly where the schedule says. ``tests/test_lightning_seam.py`` fails if
Lightning changes this arithmetic.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


def set_divisor(trainer: Any, value: int) -> None:
    """Make Lightning's automatic loop step after ``value``-aligned batches and divide by ``value``."""
    trainer.accumulate_grad_batches = value


def zero_grad_like_lightning(trainer: Any, pl_module: Any, batch_idx: int, optimizer: Optimizer) -> None:
    """Zero gradients through the same hooks Lightning's loop uses, so that user overrides of
    ``optimizer_zero_grad`` and ``on_before_zero_grad`` (and :class:`GradientDecay`) still apply."""
    for callback in trainer.callbacks:
        callback.on_before_zero_grad(trainer, pl_module, optimizer)
    pl_module.on_before_zero_grad(optimizer)
    pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)


def epoch_ends_after_this_batch(trainer: Any) -> bool:
    """Whether the batch being trained is the epoch's last (data exhausted or the batch limit).

    ``trainer.is_last_batch`` comes from the prefetching data fetcher; the batch index, which
    only the epoch loop holds, covers ``limit_train_batches``.
    """
    batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    return bool(trainer.is_last_batch) or batch_idx + 1 >= trainer.num_training_batches
