"""The noise probe: what each accumulation window measures for the gradient-noise estimator
(``lightning_accum.noise``), and the strategies under which it cannot measure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_accum._core import collectives, sync
from lightning_accum._core.gradients import squared_norm
from lightning_accum.noise import NoiseScale, NoiseScaleEstimator, PrefixChain
from lightning_accum.schedules import Schedule


def measured(microbatches: int) -> bool:
    """Whether the probe measures after this many micro-batches of a window: after 1, 4, 16, 64,
    ... The fit's information grows with the log of the prefix sizes' ratios
    (``fit_prefixes``), so geometric prefixes keep nearly all of it
    (at k = 16, 1.2 against 1.37 for every prefix, 0.88 for the first alone) for a norm of the
    gradient at ``log4(k)`` micro-batches instead of ``k - 1``."""
    return microbatches > 0 and microbatches & (microbatches - 1) == 0 and (microbatches.bit_length() - 1) % 2 == 0


class NoiseProbe:
    """Feeds a ``NoiseScale`` (or a bare ``NoiseScaleEstimator``, for AdaScale) from the
    windows: the squared norm of the accumulated gradient after micro-batches 1, 4, 16, ... but
    the last (local: one fused norm, no host sync, no collective), and the window's final gradient. At the
    window's end each rank fits its own chain of prefixes (``fit_prefixes``; the last prefix
    is the gradient over all ranks) and the fits are averaged over ranks in one all-reduce. Batch
    sizes are in samples for ``normalize="mean"`` and in items for ``"items"``."""

    def __init__(self, target: NoiseScale | NoiseScaleEstimator, normalize: str) -> None:
        self.target = target
        self.normalize = normalize
        self._pending: list[tuple[Tensor, float | Tensor]] = []  # (squared norm of the sum, batch)
        self._chain = PrefixChain()

    def prefix(self, grads: Sequence[Tensor], window: Any, loss_scale: float = 1.0) -> None:
        """The gradient after the window's latest micro-batch (called where ``measured``): it
        was divided by the window's loss divisor and multiplied by the AMP ``loss_scale``; for
        ``"mean"`` each micro-batch's loss is a mean over its samples (the prefix's mean is then
        over micro-batches)."""
        sq = squared_norm(grads) * (window.divisor / loss_scale) ** 2  # |sum of losses' gradients|^2
        if self.normalize == "mean":
            batch: float | Tensor = window.samples
            sq = sq * (window.samples / window.microbatches) ** 2
        else:
            batch = window.items + (torch.stack(window.pending_items).sum() if window.pending_items else 0)
        self._pending.append((sq, batch))

    def pending(self) -> list[Tensor | float]:
        """The prefixes measured since the last read, flat (squared norm, batch, ...), as device scalars:
        read with the window's counts, in one transfer (``settle``)."""
        return [v for sq, batch in self._pending for v in (sq, batch)]

    def settle(self, values: Sequence[float]) -> None:
        """``pending()``, read: added to the window's chain of prefixes."""
        self._pending.clear()
        for i in range(0, len(values), 2):
            self._chain.add(values[i + 1], values[i])

    def _fold(self) -> PrefixChain:
        if self._pending:
            pairs = [torch.stack([sq, torch.as_tensor(b, dtype=sq.dtype, device=sq.device)]) for sq, b in self._pending]
            self.settle(torch.stack(pairs).reshape(-1).tolist())  # one host sync (a checkpoint's)
        return self._chain

    def numbers(self) -> list[float]:
        """The open window's prefixes so far, as four numbers (for checkpoints, per rank)."""
        return self._fold().values()

    def load_numbers(self, values: Sequence[float]) -> None:
        self._pending.clear()
        self._chain = PrefixChain(values)

    def forget(self) -> None:
        """Drop the open window's prefixes (a window dropped unstepped: nothing of it is measured)."""
        self.load_numbers((0.0, 0.0, 0.0, 0.0))

    def state_dict(self) -> dict[str, Any]:
        """The open window's prefixes, so that a checkpoint inside the window keeps them."""
        chain = self._fold()
        return {"chain": chain.values()} if chain.batch else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.load_numbers(state.get("chain", (0.0, 0.0, 0.0, 0.0)))

    def window_end(self, strategy: Any, final_sq: float, counts: Sequence[int]) -> None:
        """Feed the target: ``final_sq`` is the squared norm of the window's final (normalised) gradient
        and ``counts`` its global (micro-batches, samples, items)."""
        chain = self._fold()
        self._chain = PrefixChain()
        world = collectives.world_size(strategy)
        if counts[0] <= world:
            return  # (no rank has two micro-batches: no rank took a prefix, and none all-reduces)
        units = counts[1] if self.normalize == "mean" else counts[2]
        fit: tuple[float, float] = (math.nan, math.nan)
        if chain.batch:  # (a rank that took no prefix, or none of any item, has no fit: the window measures nothing)
            chain.add(units, final_sq * units**2)
            fit = chain.solve() or fit
        grad_sq, trace = collectives.mean_over_ranks(strategy, list(fit))  # (every rank, whatever its chain)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return  # (nor what its micro-batch steps added: averaged over the measuring windows only)
        steps = counts[0] / world  # micro-batches per rank
        if isinstance(self.target, NoiseScale):
            self.target.record(grad_sq, trace, counts[0], units / steps)
        else:
            self.target.add(grad_sq, trace, counts[0])

    @property
    def estimator(self) -> NoiseScaleEstimator:
        return self.target.estimator if isinstance(self.target, NoiseScale) else self.target


def check_noise_under(plan: sync.SyncPlan, schedule: Schedule, lr_scaling: str | None = None) -> None:
    """A ``NoiseScale`` (and AdaScale) needs each rank's whole gradient after the window's
    first micro-batch; FSDP and FSDP2 keep it sharded (or in their own unsharded buffers),
    DeepSpeed in its own."""
    who = "`NoiseScale`" if isinstance(schedule, NoiseScale) else "`lr_scaling='adascale'`"
    if (isinstance(schedule, NoiseScale) or lr_scaling == "adascale") and plan.buffers_partial_window:
        raise RuntimeError(
            f"{who} cannot measure the gradient noise under {plan.family.upper()}: the gradient after a "
            "window's first micro-batch is sharded or held in the strategy's own buffers. Use DDP, or a `Ramp`/"
            "`Piecewise` schedule with this strategy."
        )
