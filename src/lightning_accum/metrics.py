"""The loss of the window the optimizer steps with (and of each task in it).

Each micro-batch's loss (as it went into backward, before the window's division) is summed on
its device as the window fills: no host transfer per micro-batch. The sums join the window's
count all-reduce (``WindowEngine.close``) and are divided by the window's global count (its
micro-batches for ``normalize="mean"``, its items for ``"items"``): the same normaliser its
gradient had, so the reported loss is exactly the quantity whose gradient was stepped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

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


class WindowMetrics:
    """Device sums of an open window's losses, by name (``"loss"`` for the window, task names
    beside), while tracking (``log=True``). The micro-batch under way is held apart until its
    backward pass finishes (``commit``), so that one an exception cut short can be taken back.

    Example:

        >>> metrics = WindowMetrics()
        >>> metrics.tracking = True
        >>> metrics.add_loss(torch.tensor(3.0)); metrics.commit()
        >>> metrics.add_loss(torch.tensor(5.0)); metrics.commit()
        >>> names, sums = metrics.local_sums()
        >>> names, [float(s) for s in sums]
        (['loss'], [8.0])
    """

    def __init__(self) -> None:
        self.tracking = False
        self._sums: dict[str, Tensor | float] = {}
        self._pending: dict[str, Tensor] = {}
        self._grad_sq: Tensor | None = None

    def clear(self) -> None:
        """Forget the window's losses (a new window, or one redone from its start)."""
        self._sums, self._pending, self._grad_sq = {}, {}, None

    def add_loss(self, loss: Tensor, name: str = "loss") -> None:
        """A micro-batch's loss as it went into backward (before the window's division), or a task's."""
        if self.tracking:
            value = loss.detach().to(torch.float64)
            held = self._pending.get(name)
            self._pending[name] = value if held is None else held + value

    def commit(self) -> None:
        """The micro-batch's backward pass finished: its losses are the window's."""
        for name, value in self._pending.items():
            total = self._sums.get(name)
            self._sums[name] = value if total is None else total + value
        if self._pending:
            self._pending = {}

    def drop(self) -> None:
        """The micro-batch under way is taken back (its gradient never reached the window)."""
        self._pending = {}

    def local_sums(self) -> tuple[list[str], list[Tensor | float]]:
        """This rank's committed sums, by sorted name (every rank logs the same names)."""
        names = sorted(self._sums)
        return names, [self._sums[name] for name in names]

    def load_sums(self, names: Sequence[str], values: Sequence[float]) -> None:
        """Put back sums a checkpoint held (this rank's)."""
        self.clear()
        self._sums = dict(zip(names, (float(v) for v in values), strict=True))

    def add_grad_norm(self, grads: Sequence[Tensor]) -> None:
        """Where the window's gradient is made global after its counts (the mixin under DDP): the
        normalised gradient (of one of the group's optimizers), before clipping."""
        if self.tracking:
            sq = squared_norm(grads)
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq.to(self._grad_sq.device)

    def grad_norm_on_device(self) -> Tensor | None:
        """What ``add_grad_norm`` measured, as a device scalar (``None`` if nothing)."""
        return None if self._grad_sq is None else self._grad_sq.sqrt()
