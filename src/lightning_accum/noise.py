r"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` predicts the
critical batch size, where ``G`` is the true gradient and ``Sigma`` the per-sample
gradient covariance. The squared norm of a gradient averaged over ``B`` samples has
expectation ``|G|^2 + tr(Sigma)/B``, so gradients at several batch sizes
give unbiased estimates of both by linear regression.

A window offers one measurement per micro-batch for free (``lightning_accum._core.probe``);
``fit_prefixes`` fits them, and windows are averaged before dividing, so that the ratio's
bias (second order in its denominator's relative error) stays negligible.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import override

from lightning_accum.schedules import Progress, Schedule, _check_k


class PrefixChain:
    """Sufficient statistics of ``fit_prefixes`` over nested prefixes added in order.

    Each prefix is ``(batch, sum_sq)``: ``sum_sq`` is the squared norm of the *sum* of the
    per-sample gradients of its ``batch`` samples (``batch**2`` times that of their mean). The
    increments ``D_i = sum_sq_i - sum_sq_{i-1}`` have expectation
    ``(B_i**2 - B_{i-1}**2) |G|^2 + (B_i - B_{i-1}) tr(Sigma)`` and, where noise dominates,
    variance proportional to ``B_i**2 - B_{i-1}**2``; weighted least squares with those weights
    telescopes to four numbers.
    """

    __slots__ = ("batch", "h", "sum_sq", "v")

    def __init__(self, values: Sequence[float] = (0.0, 0.0, 0.0, 0.0)) -> None:
        self.h, self.v, self.sum_sq, self.batch = (float(x) for x in values)

    def add(self, batch: float, sum_sq: float) -> None:
        """The next prefix (ignored unless it is larger than the last)."""
        if not batch > self.batch or not math.isfinite(sum_sq):
            return
        self.h += (batch - self.batch) / (batch + self.batch)
        self.v += (sum_sq - self.sum_sq) / (batch + self.batch)
        self.sum_sq, self.batch = sum_sq, batch

    def solve(self) -> tuple[float, float] | None:
        """``(|G|^2, tr(Sigma))``, or ``None`` with fewer than two prefixes."""
        if self.h <= 1.0 + 1e-12 or self.batch <= 0:
            return None
        y = self.sum_sq / self.batch**2  # the last prefix's mean gradient, squared
        grad_sq = (self.h * y - self.v / self.batch) / (self.h - 1.0)
        trace = (self.v - self.batch * y) / (self.h - 1.0)
        return grad_sq, trace

    def values(self) -> list[float]:
        return [self.h, self.v, self.sum_sq, self.batch]


def fit_prefixes(batches: Sequence[float], sq_norms: Sequence[float]) -> tuple[float, float] | None:
    r"""Unbiased ``(|G|^2, tr(Sigma))`` from the squared norms of mean gradients over nested
    prefixes of one batch (``batches`` increasing): the regression of ``|g_B|^2`` on ``1/B`` in
    the increments' weighted least squares. Two prefixes give the classic two-batch estimate.

    Variance, for ``k`` equal micro-batches (``B = kb``) and Gaussian noise dominating the
    signal, with ``H_k = sum_{i <= k} 1/(2i-1) ~ ln(4k)/2 + 0.29``::

        Var(estimated tr(Sigma)) ~ 2 tr(Sigma^2) / (H_k - 1)
        Var(estimated |G|^2)     ~ 2 tr(Sigma^2) H_k / (B^2 (H_k - 1))

    Heavy-tailed per-sample gradients and the signal's own term raise both: on
    ``benchmarks/noise_study.py``'s regression (``k = 16`` micro-batches of 4) the measured
    variances are 4.8x (``|G|^2``) and 7x (trace) these; the two-batch estimate from the same
    window (first micro-batch and whole window) has 1.5x and 1.75x the variance of this one.

    Example:

        >>> # |G|^2 = 1, tr(Sigma) = 8: E|g_B|^2 = 1 + 8 / B
        >>> grad_sq, trace = fit_prefixes([2, 4, 8], [1 + 8 / 2, 1 + 8 / 4, 1 + 8 / 8])
        >>> round(grad_sq, 9), round(trace, 9)
        (1.0, 8.0)
    """
    chain = PrefixChain()
    for batch, sq in zip(batches, sq_norms, strict=True):
        chain.add(batch, sq * batch**2)
    return chain.solve()


class NoiseScaleEstimator:
    r"""Moving averages of per-window unbiased estimates of ``|G|^2`` and
    ``tr(Sigma)``, weighted by each window's micro-batches and decayed by
    ``beta`` per window (about ``1 / (1 - beta)`` windows of memory; normalised, so there is no
    start-up bias). On ``benchmarks/noise_study.py``'s regression, with ``NoiseScale``'s
    other defaults, ``beta=0.995`` put the final k of 160 of 160 seeds within 25 % of the truth.

    Example:

        >>> est = NoiseScaleEstimator(beta=0.0)
        >>> # |G|^2 = 1, tr(Sigma) = 8: E|g_B|^2 = 1 + 8 / B
        >>> est.update(small_sq=1 + 8 / 2, small_batch=2, big_sq=1 + 8 / 8, big_batch=8)
        >>> round(est.noise_scale, 6)
        8.0
    """

    def __init__(self, beta: float = 0.995) -> None:
        if not _real(beta) or not 0.0 <= beta < 1.0:
            raise ValueError(f"`beta` (moving-average decay per window) must be a number in [0, 1); got {beta!r}.")
        self.beta = beta
        self._sums = [0.0] * 3  # decayed weighted sums of 1, |G|^2 and tr(Sigma)
        self.updates = 0

    def add(self, grad_sq: float, trace: float, weight: float = 1.0) -> None:
        """One window's estimates (ignored unless finite), weighted by ``weight`` > 0."""
        if not (math.isfinite(grad_sq) and math.isfinite(trace) and weight > 0):
            return
        b = self.beta
        self._sums = [b * s + weight * t for s, t in zip(self._sums, (1.0, grad_sq, trace), strict=True)]
        self.updates += 1

    def update(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> None:
        """The two-batch shortcut: squared norms of the mean gradient over ``small_batch`` and
        over ``big_batch`` samples (nested), weighted ``big_batch / small_batch``."""
        if big_batch > small_batch > 0:
            fit = fit_prefixes([small_batch, big_batch], [small_sq, big_sq])
            if fit is not None:
                self.add(*fit, weight=big_batch / small_batch)

    def _mean(self, i: int) -> float:
        return self._sums[i] / self._sums[0] if self._sums[0] else 0.0

    @property
    def grad_sq(self) -> float:
        """The averaged estimate of ``|G|^2`` (0 before any update)."""
        return self._mean(1)

    @property
    def trace(self) -> float:
        r"""The averaged estimate of ``tr(Sigma)`` (0 before any update)."""
        return self._mean(2)

    @property
    def noise_scale(self) -> float:
        r"""``B_simple`` from the averaged estimates (``nan`` before any update or if
        ``|G|^2 <= 0``)."""
        if self.updates == 0 or self.grad_sq <= 0:
            return math.nan
        return max(self.trace, 0.0) / self.grad_sq

    def state_dict(self) -> dict[str, Any]:
        """The estimator's running sums and update count, for checkpoints."""
        return {"sums": list(self._sums), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.updates = int(state["updates"])
        if "sums" in state:
            self._sums = [float(x) for x in state["sums"]]
        else:  # version 0.1: bias-corrected EMAs, kept as one window's worth
            corr = 1 - self.beta**self.updates if self.updates else 1.0
            g, t = float(state["grad_sq"]) / corr, float(state["trace"]) / corr
            self._sums = [1.0, g, t] if self.updates else [0.0] * 3


class NoiseScale(Schedule):
    """Adaptive k: the window's effective batch follows the measured noise scale.

    ``k = clamp(round(B_simple / u), min_k, max_k)``, where ``u`` is what one micro-batch step
    adds over all ranks (samples, or items with ``normalize="items"``). ``k`` changes at most
    every ``every`` optimizer steps, only once ``warmup`` windows were measured, only by more
    than ``hysteresis`` (relative), so that noise in the estimate does not make it flap, and by
    at most a factor ``max_ratio`` at a time, so that the first windows' noisy estimates (a
    window of 2 micro-batches says little about ``|G|^2``) cannot send k to ``max_k``.
    The defaults were chosen on the regression of ``benchmarks/noise_study.py`` (160 seeds: every
    final k within 25 % of the truth; the version 0.1 defaults: 22 of 40).
    The accumulation callback or mixin feeds it measurements (``observe``) from statistics
    all-reduced over ranks, so every rank computes the same k. A window of one micro-batch
    measures nothing (under DDP its only gradient is already all-reduced), hence ``min_k >= 2``;
    so does a short last window of one micro-batch.

    Example:

        >>> schedule = NoiseScale(2, 16, every=1, warmup=1, beta=0.0, max_ratio=4)
        >>> schedule.observe(small_sq=1 + 64 / 8, small_batch=8, big_sq=1 + 64 / 16, big_batch=16, per_microbatch=8)
        >>> schedule(Progress(step=1))  # B_simple = 64 samples = 8 micro-batches of 8
        8
    """

    unit = None
    rank_consistent = True  # fed statistics all-reduced over ranks
    measures_noise = True  # (in windows of a fixed k: not a `Budget`'s size)

    def __init__(
        self,
        min_k: int,
        max_k: int,
        *,
        start: int | None = None,
        every: int = 10,
        warmup: int = 5,
        hysteresis: float = 0.05,
        beta: float = 0.995,
        max_ratio: float = 2.0,
    ) -> None:
        self.min_k = _check_k(min_k, "min_k")
        self.max_k = _check_k(max_k, "max_k")
        if self.min_k < 2:
            raise ValueError(
                "`min_k` must be >= 2: the noise scale is measured between a window's first micro-batch and the "
                "whole window, so a window of one micro-batch measures nothing."
            )
        if self.max_k < self.min_k:
            raise ValueError(f"`max_k`={max_k} is below `min_k`={min_k}.")
        self.start = self.min_k if start is None else _check_k(start, "start")
        if not self.min_k <= self.start <= self.max_k:
            raise ValueError(f"`start`={start} must lie in [min_k, max_k] = [{min_k}, {max_k}].")
        self.every = _check_k(every, "every", what="optimizer steps between changes of k")
        self.warmup = _check_k(warmup, "warmup", what="windows measured before k may change")
        if not _real(hysteresis) or not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"`hysteresis` must be a number in [0, 1); got {hysteresis!r}.")
        self.hysteresis = hysteresis
        if not _real(max_ratio) or not max_ratio > 1.0:
            raise ValueError(
                f"`max_ratio` (the most k may change by at a time) must be a number > 1; got {max_ratio!r}."
            )
        self.max_ratio = float(max_ratio)
        self.estimator = NoiseScaleEstimator(beta)
        self._k, self._changed_at = self.start, 0
        self._units = [0.0, 0.0]  # decayed sums: units per micro-batch step x weight, weight

    def observe(
        self, small_sq: float, small_batch: float, big_sq: float, big_batch: float, per_microbatch: float
    ) -> None:
        """One window's two-batch measurement: squared gradient norms at two nested batch sizes, and
        what one micro-batch step adds over all ranks (in the same unit as the batch sizes)."""
        self.estimator.update(small_sq, small_batch, big_sq, big_batch)
        self._add_units(per_microbatch, 1.0)

    def record(self, grad_sq: float, trace: float, weight: float, per_microbatch: float) -> None:
        """One window's estimates (from ``fit_prefixes``), weighted by its micro-batches."""
        self.estimator.add(grad_sq, trace, weight)
        self._add_units(per_microbatch, weight)

    def _add_units(self, per_microbatch: float, weight: float) -> None:
        """What a micro-batch step adds, averaged over windows like the estimates: an epoch's last
        micro-batch may be short, and its window alone would make k too large."""
        beta = self.estimator.beta
        self._units = [beta * self._units[0] + per_microbatch * weight, beta * self._units[1] + weight]

    @property
    def _per_microbatch(self) -> float:
        return self._units[0] / self._units[1] if self._units[1] else 0.0

    @property
    def noise_scale(self) -> float:
        """The smoothed estimate of B_simple (samples or items; ``nan`` before any measurement)."""
        return self.estimator.noise_scale

    @property
    def current_k(self) -> int:
        """The k in force: what the next window gets unless a measurement moves it."""
        return self._k

    @override
    def k(self, progress: Progress) -> int:
        """The ``k`` the measured noise scale asks for, changed at most every ``every`` steps after the
        ``warmup`` measurements, bounded by ``min_k``, ``max_k`` and ``max_ratio``."""
        ready = self.estimator.updates >= self.warmup and progress.step - self._changed_at >= self.every
        b = self.estimator.noise_scale
        if ready and math.isfinite(b) and self._per_microbatch > 0:
            k, r = self._k, self.max_ratio
            low, high = max(self.min_k, min(math.ceil(k / r), k - 1)), min(self.max_k, max(math.floor(k * r), k + 1))
            target = min(max(round(b / self._per_microbatch), low), high)
            if abs(target - self._k) > self.hysteresis * self._k:
                self._k, self._changed_at = target, progress.step
        return self._k

    @override
    def state_dict(self) -> dict[str, Any]:
        """The estimator's state and the schedule's current ``k``, for checkpoints."""
        numbers = {"k": self._k, "changed_at": self._changed_at, "units": self._units}
        return {"estimator": self.estimator.state_dict(), **numbers}

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (warns if the checkpoint holds none)."""
        if "estimator" not in state_dict:
            warnings.warn(
                "The checkpoint holds no `NoiseScale` state (it was written under another schedule): the noise "
                f"estimate starts afresh, from k = {self._k}, and k may change after `warmup` = {self.warmup} windows.",
                stacklevel=2,
            )
            return
        self.estimator.load_state_dict(state_dict["estimator"])
        self._k = int(state_dict["k"])
        self._changed_at = int(state_dict["changed_at"])
        units = state_dict.get("units", (state_dict.get("per_microbatch", 0.0), 1.0))  # (before: the last window's)
        self._units = [float(x) for x in units]

    @override
    def __repr__(self) -> str:
        return (
            f"NoiseScale({self.min_k}, {self.max_k}, start={self.start}, every={self.every}, warmup={self.warmup}, "
            f"hysteresis={self.hysteresis}, beta={self.estimator.beta}, max_ratio={self.max_ratio})"
        )


def _real(value: object) -> bool:
    """A real number (not a bool, not a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
