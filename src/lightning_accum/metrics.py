"""The loss of the window the optimizer steps with (and of each task in it).

Each micro-batch's loss (as it went into backward, before the window's division) is summed on
its device as the window fills: no host transfer per micro-batch. When the window is logged, the
sums are added over ranks by ``torchmetrics`` and divided by the window's global count (its
micro-batches for ``normalize="mean"``, its items for ``"items"``): the same normaliser its
gradient had, so the logged loss is exactly the quantity whose gradient was stepped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics.aggregation import SumMetric

from lightning_accum.gradients import squared_norm


def weigh(loss: Tensor, items: int | Tensor) -> Tensor:
    """A mean loss times its item count: the micro-batch's summed loss. 0 when it has no items
    (a mean over no tokens is ``nan``, as Hugging Face losses return it), gradient included.

    Example:

        >>> weigh(torch.tensor(float("nan")), 0).item(), weigh(torch.tensor(2.0), 3).item()
        (0.0, 6.0)
    """
    weighted = loss * items
    if isinstance(items, Tensor):
        return torch.where(items != 0, weighted, torch.zeros_like(weighted))
    return weighted if items else torch.zeros_like(weighted)


class WindowLoss:
    """Device sums of a window's losses, by name (``"loss"`` for the window, task names beside).

    Example:

        >>> losses = WindowLoss()
        >>> losses.add(torch.tensor(3.0)); losses.add(torch.tensor(5.0))
        >>> losses.compute(denominator=2)["loss"].item()  # the mean over the window's micro-batches
        4.0
    """

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self._metrics: dict[str, SumMetric] = {}  # one torchmetrics reducer per name, reused

    def add(self, loss: Tensor, name: str = "loss") -> None:
        value = loss.detach().to(torch.float64)
        total = self._sums.get(name)
        self._sums[name] = value if total is None else total + value

    def compute(self, denominator: float) -> dict[str, Tensor]:
        """Each sum over all ranks (a collective where a process group runs), over ``denominator``;
        then empty for the next window."""
        out = {}
        for name, total in self._sums.items():
            metric = self._metrics.get(name)
            if metric is None:
                metric = self._metrics[name] = SumMetric(nan_strategy="disable")
                metric.set_dtype(torch.float64)
            metric.to(total.device).update(total)
            out[name] = metric.compute() / denominator
            metric.reset()
        self._sums = {}
        return out

    def clear(self) -> None:
        self._sums = {}


class WindowMetrics:
    """What is logged of a window, tracked only for the windows that are logged: every
    ``log_every`` optimizer steps (0: never) and the first."""

    def __init__(self) -> None:
        self.log_every = 0
        self.tracking = False
        self.losses = WindowLoss()
        self._grad_sq: Tensor | None = None

    def every(self, steps: int) -> None:
        """Track the windows whose step is logged: every ``steps`` optimizer steps (0: none) and the first."""
        self.log_every = steps

    def start(self, step: int) -> None:
        """A window opens that ends with optimizer step ``step``."""
        self.tracking = bool(self.log_every) and (step % self.log_every == 0 or step == 1)
        self.losses.clear()
        self._grad_sq = None

    def restart(self) -> None:
        """Forget the losses added so far (the window is redone from its start)."""
        self.losses.clear()

    def add_loss(self, loss: Tensor, name: str = "loss") -> None:
        """A micro-batch's loss as it went into backward (before the window's division), or a task's."""
        if self.tracking:
            self.losses.add(loss, name)

    def add_grad_norm(self, grads: Sequence[Tensor]) -> None:
        """The normalised window gradient (of one of the group's optimizers), before clipping."""
        if self.tracking:
            sq = squared_norm(grads)
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq.to(self._grad_sq.device)

    def compute(self, denominator: float) -> dict[str, Tensor]:
        """The window's losses over all ranks, over its global count, and its gradient norm."""
        if not self.tracking:
            return {}
        metrics = self.losses.compute(denominator) if denominator else {}
        if self._grad_sq is not None:
            metrics["grad_norm"] = self._grad_sq.sqrt()
        return metrics
