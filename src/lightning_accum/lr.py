"""Learning-rate multipliers keyed on training progress, for ``lr_schedule=``.

With a batch-size ramp the number of optimizer steps is not ``batches / k``, so a warm-up or a
decay written in steps ends at the wrong point. Keyed on samples or items (tokens), the same
schedule follows what the model has seen, whatever the windows. Each shape maps a
``Progress`` to a multiplier of every parameter group's learning rate,
composed by multiplication with the Trainer's LR scheduler and with ``lr_scaling``.

This module is plain Python: it imports neither torch nor Lightning.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import override

from lightning_accum.noise import NoiseScaleEstimator
from lightning_accum.schedules import UNITS, Progress, _check_unit

#: what ``lr_schedule=`` takes: the learning-rate multiplier for the step of a window that opened at a ``Progress``
LRMultiplier = Callable[[Progress], float]
"""``lr_schedule(progress) -> float``: the learning-rate multiplier for the step of the window that opened
at ``progress`` (a finite number >= 0); shapes in ``lightning_accum.lr``."""


class LRSchedule:
    """Base class: ``schedule(progress) -> float``, the learning-rate multiplier of the step taken
    by the window that opened at ``progress``. Stateless shapes keep the empty ``state_dict``.

    Example:

        >>> class Halving(LRSchedule):
        ...     def multiplier(self, progress: Progress) -> float:
        ...         return 0.5 ** progress.epoch
        >>> Halving()(Progress(epoch=2))
        0.25
    """

    def multiplier(self, progress: Progress) -> float:
        """The learning-rate multiplier for the step of the window that opened at ``progress``: the
        method a shape of your own defines (``__call__`` checks it is a finite number >= 0)."""
        raise NotImplementedError

    def __call__(self, progress: Progress) -> float:
        return self.multiplier(progress)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the shape (nothing for a stateless one)."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; stateless shapes have nothing to restore."""


def _count(value: object, name: str, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be a number >= 0 of `unit` ({unit!r}); got {value!r}.")
    return float(value)


def _fraction(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"`{name}` must be a multiplier in [0, 1]; got {value!r}.")
    return float(value)


class _Warmup(LRSchedule):
    """Linear warm-up from ``start`` to 1 over ``warmup`` units, then a decay to ``final`` at ``total``."""

    def __init__(self, warmup: float, total: float, unit: str = "step", final: float = 0.0, start: float = 0.0) -> None:
        self.unit = _check_unit(unit, UNITS)
        self.warmup = _count(warmup, "warmup", unit)
        self.total = _count(total, "total", unit)
        if self.total <= self.warmup:
            raise ValueError(f"`total`={total} must be greater than `warmup`={warmup} (both in {unit!r}).")
        self.final = _fraction(final, "final")
        self.start = _fraction(start, "start")

    @override
    def multiplier(self, progress: Progress) -> float:
        """Linear warm-up from ``start`` to 1, then the decay to ``final`` at ``total``, in ``unit``."""
        x = float(progress.value(self.unit))
        if x < self.warmup:
            return self.start + (1.0 - self.start) * x / self.warmup
        t = min(1.0, (x - self.warmup) / (self.total - self.warmup))
        return self.final + (1.0 - self.final) * self._decay(t)

    def _decay(self, t: float) -> float:
        raise NotImplementedError

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.warmup:g}, {self.total:g}, unit={self.unit!r}, final={self.final:g}, "
            f"start={self.start:g})"
        )


class WarmupCosine(_Warmup):
    """Linear warm-up over ``warmup`` units, then a half cosine from 1 down to ``final`` at ``total``
    (and ``final`` after it). ``unit``: ``"step"``, ``"samples"``, ``"items"`` or ``"epoch"``.

    Example:

        >>> lr = WarmupCosine(warmup=100, total=1100, unit="samples", final=0.1)
        >>> [round(lr(Progress(samples=s)), 3) for s in (0, 50, 100, 600, 1100, 2000)]
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """

    @override
    def _decay(self, t: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * t))


class WarmupLinear(_Warmup):
    """Linear warm-up over ``warmup`` units, then a straight line from 1 down to ``final`` at
    ``total`` (and ``final`` after it), like ``get_linear_schedule_with_warmup`` keyed on any unit.

    Example:

        >>> lr = WarmupLinear(warmup=10, total=110, unit="step")
        >>> [lr(Progress(step=s)) for s in (0, 5, 10, 60, 110)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    @override
    def _decay(self, t: float) -> float:
        return 1.0 - t


def check_multiplier(value: object, schedule: object, progress: Progress) -> float:
    """A multiplier returned by ``lr_schedule`` as a finite float >= 0, or an error naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`lr_schedule` {schedule!r} returned {value!r} at {progress}; it must return a finite learning-rate "
            "multiplier >= 0."
        )
    if float(value) > MAX_MULTIPLIER:
        raise ValueError(
            f"`lr_schedule` {schedule!r} returned {value!r} at {progress}: a multiplier of the optimizer's learning "
            f"rate above {MAX_MULTIPLIER:g} is surely a mistake. Return a factor (e.g. in [0, 1]) and set the peak "
            "learning rate on the optimizer."
        )
    return float(value)


#: the largest learning-rate multiplier ``lr_schedule`` may return
MAX_MULTIPLIER = 1e3


def adascale_gain(estimator: NoiseScaleEstimator, batch: float, first_batch: float) -> float:
    r"""AdaScale's gain (Johnson et al., ICML 2020) for a step with an effective batch of ``batch``
    against ``first_batch``, the first stepped window's (same units; a window of no items is not stepped)::

        r = (tr(Sigma) / B_0 + |G|^2) / (tr(Sigma) / B + |G|^2)

    from the smoothed estimates (their start-up bias cancels in the ratio). It lies in
    ``[1, B / B_0]`` for ``B >= B_0``: 1 where the gradient noise is small against the signal, the
    linear rule where noise dominates. 1 before any measurement.

    Example:

        >>> est = NoiseScaleEstimator(beta=0.0)
        >>> est.update(small_sq=1 + 8 / 2, small_batch=2, big_sq=1 + 8 / 8, big_batch=8)  # |G|^2 = 1, tr = 8
        >>> adascale_gain(est, batch=8, first_batch=2)  # (8/2 + 1) / (8/8 + 1)
        2.5
    """
    trace, grad_sq = max(estimator.trace, 0.0), max(estimator.grad_sq, 0.0)
    if estimator.updates == 0 or batch <= 0 or first_batch <= 0 or trace + grad_sq == 0:
        return 1.0
    return (trace / first_batch + grad_sq) / (trace / batch + grad_sq)
