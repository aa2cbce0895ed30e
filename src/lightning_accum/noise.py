r"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

The simple noise scale :math:`B_{simple} = \operatorname{tr}(\Sigma) / |G|^2` predicts the
critical batch size, where :math:`G` is the true gradient and :math:`\Sigma` the per-sample
gradient covariance. The squared norm of a gradient averaged over :math:`B` samples has
expectation :math:`|G|^2 + \operatorname{tr}(\Sigma)/B`, so two batch sizes
:math:`B_s < B_b` with measured squared norms :math:`|g_s|^2, |g_b|^2` give unbiased
estimates

.. math::

    |G|^2 \approx \frac{B_b |g_b|^2 - B_s |g_s|^2}{B_b - B_s}, \qquad
    \operatorname{tr}(\Sigma) \approx \frac{|g_s|^2 - |g_b|^2}{1/B_s - 1/B_b}.

Each is smoothed with an exponential moving average before dividing (single estimates are
very noisy and the ratio of noisy numbers is biased). Within one accumulation window both
measurements come for free: the gradient after the window's first micro-batch (``B_s`` = its
samples) and the window's final, normalised gradient (``B_b`` = the window's samples over all
ranks): no extra gradient copy is needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_accum import collectives, sync
from lightning_accum.gradients import squared_norm
from lightning_accum.schedules import Progress, Schedule, _check_k


class NoiseScaleEstimator:
    """EMA-smoothed unbiased estimates of :math:`|G|^2` and :math:`\\operatorname{tr}(\\Sigma)`.

    Example::

        >>> est = NoiseScaleEstimator(beta=0.0)
        >>> # |G|^2 = 1, tr(Sigma) = 8: E|g_B|^2 = 1 + 8 / B
        >>> est.update(small_sq=1 + 8 / 2, small_batch=2, big_sq=1 + 8 / 8, big_batch=8)
        >>> round(est.noise_scale, 6)
        8.0
    """

    def __init__(self, beta: float = 0.95) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"`beta` (EMA smoothing) must be in [0, 1); got {beta!r}.")
        self.beta = beta
        self.grad_sq = 0.0  # EMA of |G|^2 (not yet bias-corrected)
        self.trace = 0.0  # EMA of tr(Sigma)
        self.updates = 0

    def update(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> None:
        """Add one pair of measurements; ignored unless ``big_batch > small_batch > 0`` and finite."""
        if not (big_batch > small_batch > 0) or not math.isfinite(small_sq) or not math.isfinite(big_sq):
            return
        grad_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
        trace = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
        self.grad_sq = self.beta * self.grad_sq + (1 - self.beta) * grad_sq
        self.trace = self.beta * self.trace + (1 - self.beta) * trace
        self.updates += 1

    @property
    def noise_scale(self) -> float:
        """:math:`B_{simple}` from the smoothed estimates (``nan`` before any update or if
        :math:`|G|^2 \\le 0`). The EMAs' start-up bias cancels in the ratio."""
        if self.updates == 0 or self.grad_sq <= 0:
            return math.nan
        return max(self.trace, 0.0) / self.grad_sq

    def state_dict(self) -> dict[str, Any]:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.grad_sq = float(state["grad_sq"])
        self.trace = float(state["trace"])
        self.updates = int(state["updates"])


class NoiseScale(Schedule):
    """Adaptive k: the window's effective batch follows the measured noise scale.

    ``k = clamp(round(B_simple / u), min_k, max_k)``, where ``u`` is what one micro-batch step
    adds over all ranks (samples, or items with ``normalize="items"``). ``k`` changes at most
    every ``every`` optimizer steps, only once ``warmup`` windows were measured, and only by
    more than ``hysteresis`` (relative), so that noise in the estimate does not make it flap.
    The accumulation callback or mixin feeds it measurements (``observe``) from statistics
    all-reduced over ranks, so every rank computes the same k. A window of one micro-batch
    measures nothing (under DDP its only gradient is already all-reduced), hence ``min_k >= 2``;
    so does a short last window of one micro-batch.

    Example::

        >>> schedule = NoiseScale(2, 16, every=1, warmup=1, beta=0.0)
        >>> schedule.observe(small_sq=1 + 64 / 8, small_batch=8, big_sq=1 + 64 / 16, big_batch=16, per_microbatch=8)
        >>> schedule(Progress(step=1))  # B_simple = 64 samples = 8 micro-batches of 8
        8
    """

    unit = None
    rank_consistent = True  # fed statistics all-reduced over ranks

    def __init__(
        self,
        min_k: int,
        max_k: int,
        *,
        start: int | None = None,
        every: int = 10,
        warmup: int = 5,
        hysteresis: float = 0.2,
        beta: float = 0.95,
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
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"`hysteresis` must be in [0, 1); got {hysteresis!r}.")
        self.hysteresis = hysteresis
        self.estimator = NoiseScaleEstimator(beta)
        self._k = self.start
        self._changed_at = 0
        self._per_microbatch = 0.0

    def observe(
        self, small_sq: float, small_batch: float, big_sq: float, big_batch: float, per_microbatch: float
    ) -> None:
        """One window's measurements: squared gradient norms at two batch sizes, and what one
        micro-batch step adds over all ranks (in the same unit as the batch sizes)."""
        self.estimator.update(small_sq, small_batch, big_sq, big_batch)
        self._per_microbatch = per_microbatch

    @property
    def noise_scale(self) -> float:
        return self.estimator.noise_scale

    def k(self, progress: Progress) -> int:
        ready = self.estimator.updates >= self.warmup and progress.step - self._changed_at >= self.every
        b = self.estimator.noise_scale
        if ready and math.isfinite(b) and self._per_microbatch > 0:
            target = min(max(round(b / self._per_microbatch), self.min_k), self.max_k)
            if abs(target - self._k) > self.hysteresis * self._k:
                self._k, self._changed_at = target, progress.step
        return self._k

    def state_dict(self) -> dict[str, Any]:
        return {
            "estimator": self.estimator.state_dict(),
            "k": self._k,
            "changed_at": self._changed_at,
            "per_microbatch": self._per_microbatch,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.estimator.load_state_dict(state_dict["estimator"])
        self._k = int(state_dict["k"])
        self._changed_at = int(state_dict["changed_at"])
        self._per_microbatch = float(state_dict["per_microbatch"])

    def __repr__(self) -> str:
        return (
            f"NoiseScale({self.min_k}, {self.max_k}, start={self.start}, every={self.every}, warmup={self.warmup}, "
            f"hysteresis={self.hysteresis}, beta={self.estimator.beta})"
        )


class NoiseProbe:
    """Takes the two squared norms of one window for a :class:`NoiseScale` (or a bare
    :class:`NoiseScaleEstimator`, for AdaScale): after the first micro-batch's backward and at the
    window's end, with no gradient copy. Batch sizes are in samples for ``normalize="mean"`` and
    in items for ``"items"``."""

    def __init__(self, target: NoiseScale | NoiseScaleEstimator, normalize: str) -> None:
        self.target = target
        self.normalize = normalize
        self._small: tuple[Any, float] | None = None

    def first_microbatch(self, grads: Any, window: Any, loss_scale: float = 1.0) -> None:
        """Squared norm of the window's first micro-batch's mean gradient: the raw gradient was
        divided by the window's loss divisor, multiplied by the AMP ``loss_scale`` and, for
        items, summed over the micro-batch's items."""
        units = window.samples if self.normalize == "mean" else window.local_items()
        small_sq = squared_norm(grads) * (window.divisor / loss_scale) ** 2
        if self.normalize == "items" and units:
            small_sq = small_sq / units**2
        self._small = (small_sq, units)

    def state_dict(self) -> dict[str, Any]:
        """The open window's first measurement, so that a checkpoint inside the window keeps it."""
        if self._small is None:
            return {}
        small_sq, units = self._small
        return {"small_sq": float(small_sq), "small_units": float(units)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._small = None if "small_sq" not in state else (float(state["small_sq"]), float(state["small_units"]))

    def window_end(self, strategy: Any, grads: Any, counts: Sequence[int], factor: float = 1.0) -> None:
        """Feed the schedule: ``grads * factor`` is the window's final gradient and ``counts`` its
        global (micro-batches, samples, items)."""
        if self._small is None:
            return
        small_sq, small_units = self._small
        self._small = None
        units = counts[1] if self.normalize == "mean" else counts[2]
        steps = counts[0] / collectives.world_size(strategy)  # micro-batches per rank
        stats = collectives.mean_over_ranks(strategy, [small_sq, squared_norm(grads) * factor**2])
        if not steps:
            return
        if isinstance(self.target, NoiseScale):
            self.target.observe(stats[0], small_units, stats[1], units, units / steps)
        else:
            self.target.update(stats[0], small_units, stats[1], units)

    @property
    def estimator(self) -> NoiseScaleEstimator:
        return self.target.estimator if isinstance(self.target, NoiseScale) else self.target


def adascale_gain(estimator: NoiseScaleEstimator, batch: float, first_batch: float) -> float:
    r"""AdaScale's gain (Johnson et al., ICML 2020) for a step with an effective batch of ``batch``
    against the first window's ``first_batch`` (same units):

    .. math:: r = \frac{\operatorname{tr}(\Sigma)/B_0 + |G|^2}{\operatorname{tr}(\Sigma)/B + |G|^2}

    from the smoothed estimates (their start-up bias cancels in the ratio). It lies in
    ``[1, B / B_0]`` for ``B >= B_0``: 1 where the gradient noise is small against the signal, the
    linear rule where noise dominates. 1 before any measurement.

    Example::

        >>> est = NoiseScaleEstimator(beta=0.0)
        >>> est.update(small_sq=1 + 8 / 2, small_batch=2, big_sq=1 + 8 / 8, big_batch=8)  # |G|^2 = 1, tr = 8
        >>> adascale_gain(est, batch=8, first_batch=2)  # (8/2 + 1) / (8/8 + 1)
        2.5
    """
    trace, grad_sq = max(estimator.trace, 0.0), max(estimator.grad_sq, 0.0)
    if estimator.updates == 0 or batch <= 0 or first_batch <= 0 or trace + grad_sq == 0:
        return 1.0
    return (trace / first_batch + grad_sq) / (trace / batch + grad_sq)


def check_noise_under(plan: sync.SyncPlan, schedule: Schedule, lr_scaling: str | None = None) -> None:
    """A :class:`NoiseScale` (and AdaScale) needs each rank's whole gradient after the window's
    first micro-batch; FSDP and FSDP2 keep it sharded (or in their own unsharded buffers),
    DeepSpeed in its own."""
    who = "`NoiseScale`" if isinstance(schedule, NoiseScale) else "`lr_scaling='adascale'`"
    if (isinstance(schedule, NoiseScale) or lr_scaling == "adascale") and plan.buffers_partial_window:
        raise RuntimeError(
            f"{who} cannot measure the gradient noise under {plan.family.upper()}: the gradient after a "
            "window's first micro-batch is sharded or held in the strategy's own buffers. Use DDP, or a `Ramp`/"
            "`Piecewise` schedule with this strategy."
        )
