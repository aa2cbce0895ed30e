"""The loss of the window the optimizer steps with (and of each task in it).

Each micro-batch's loss (as it went into backward, before the window's division) is summed on
its device as the window fills: no host transfer per micro-batch. The sums join the window's
count all-reduce (``WindowEngine.close``) and are divided by the window's global count (its
micro-batches for ``normalize="mean"``, its items for ``"items"``): the same normaliser its
gradient had, so the reported loss is exactly the quantity whose gradient was stepped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_accum._core.collectives import host_values
from lightning_accum._core.gradients import no_items, squared_norm


def weigh(loss: Tensor, items: float | Tensor) -> Tensor:
    """A mean loss times its item count: the micro-batch's summed loss. 0 when it has no items
    (a mean over no tokens is ``nan``, as Hugging Face losses return it), gradient included.

    Example:

        >>> weigh(torch.tensor(float("nan")), 0).item(), weigh(torch.tensor(2.0), 3).item()
        (0.0, 6.0)
    """
    weighted = loss * items
    if not isinstance(items, Tensor):
        if items:
            return weighted
        items = torch.zeros((), dtype=torch.int64, device=weighted.device)
    # (the graph is kept, so that the pass still runs: its gradient is kept out by `gradients.add_nothing_if`)
    return torch.where(items != 0, weighted, torch.zeros_like(weighted))


def window_losses(sums: Mapping[str, float], count: int) -> dict[str, float] | None:
    """The window's losses, by name: each loss's sum over all ranks over the window's global ``count`` (its
    micro-batches under ``normalize="mean"``, its items under ``"items"``: the normaliser its gradient had); ``None``
    for a count of 0 (a window nothing went into has no loss).

    Example:

        >>> window_losses({"loss": 6.0, "task": 1.5}, 3), window_losses({"loss": 0.0}, 0)
        ({'loss': 2.0, 'task': 0.5}, None)
    """
    if not count:
        return None
    losses = {}
    for name, total in sums.items():  # (a loop, not a comprehension: no function made at every window's end)
        losses[name] = total / count
    return losses


def weighted(loss: Tensor, items: int | Tensor | None) -> tuple[Tensor, bool | Tensor]:
    """A backward pass's loss as it goes in, and whether the pass must add nothing (for
    ``gradients.add_nothing_if``): a sum (``items`` is ``None``) as it is; a mean over ``items``
    weighed by them (``weigh``), adding nothing where they are 0 (its NaN gradient included).

    Example:

        >>> loss, nothing = weighted(torch.tensor(2.0), 3)
        >>> loss.item(), nothing, weighted(torch.tensor(2.0), None)[1]
        (6.0, False, False)
    """
    if items is None:
        return loss, False
    return weigh(loss, items), no_items(items)


class WindowMetrics:
    """An open window's losses, by name (``"loss"`` for the window, task names beside), while
    tracking (``log=True``): each micro-batch's detached loss is kept as it is (no device work per
    micro-batch) and summed in float64 once, at the window's end. The micro-batch under way is held
    apart until its backward pass finishes (``commit``), so that one an exception cut short can be
    taken back.

    Example:

        >>> metrics = WindowMetrics()
        >>> metrics.tracking = True
        >>> metrics.add_loss(torch.tensor(3.0)); metrics.commit()
        >>> metrics.add_loss(torch.tensor(2.5), factor=2); metrics.commit()
        >>> metrics.names(), [float(s) for s in metrics.sums()]
        (['loss'], [8.0])
    """

    def __init__(self) -> None:
        self.tracking = False
        # each loss's name, value and factor in the order added (parallel lists: a micro-batch builds nothing and
        # keeps only its detached loss); the first `_committed` are the window's, grouped by name when read
        self._names: list[str] = []
        self._values: list[Tensor | float] = []
        self._factors: list[float] = []
        self._committed = 0
        self._grad_sq: Tensor | None = None

    def clear(self) -> None:
        """Forget the window's losses (a new window, or one redone from its start)."""
        self._names, self._values, self._factors, self._committed, self._grad_sq = [], [], [], 0, None

    def add_loss(self, loss: Tensor, name: str = "loss", factor: float = 1.0) -> None:
        """A micro-batch's loss as it went into backward (before the window's division, times ``factor``),
        or a task's."""
        if self.tracking:
            self._names.append(name)
            self._values.append(loss.detach())
            self._factors.append(factor)

    def commit(self) -> None:
        """The micro-batch's backward pass finished: its losses are the window's."""
        self._committed = len(self._values)

    def drop(self) -> None:
        """The micro-batch under way is taken back (its gradient never reached the window)."""
        n = self._committed
        del self._names[n:], self._values[n:], self._factors[n:]

    def _losses(self) -> dict[str, list[tuple[Tensor | float, float]]]:
        """The committed losses by name, sorted by name: ``(loss, factor)`` in the order added."""
        losses: dict[str, list[tuple[Tensor | float, float]]] = {}
        committed = self._names[: self._committed]  # (the values and factors may run on: one under way)
        for name, value, factor in zip(committed, self._values, self._factors, strict=False):
            group = losses.get(name)
            if group is None:
                group = losses[name] = []
            group.append((value, factor))
        return losses if len(losses) < 2 else dict(sorted(losses.items()))

    def names(self) -> list[str]:
        """The names of the committed losses, sorted (every rank logs the same names)."""
        return list(self._losses())

    def sums(self) -> list[Tensor | float]:
        """This rank's committed sums, in ``names()`` order, in float64 (on the device where they are
        tensors): what the window's count all-reduce adds over ranks, and what a checkpoint keeps."""
        return [_sum(entries) for entries in self._losses().values()]

    def parts(self) -> list[tuple[str, list[Tensor], float, float]]:
        """This rank's committed losses in ``names()`` order, to be read and summed on the host: for each,
        ``(name, parts, factor, offset)``, the sum being ``factor * sum(parts) + offset``."""
        out: list[tuple[str, list[Tensor], float, float]] = []
        for name, entries in self._losses().items():
            tensors: list[Tensor] = []
            factors: set[float] = set()
            offset = 0.0
            for value, factor in entries:
                if isinstance(value, Tensor):
                    tensors.append(value)
                    factors.add(factor)
                else:
                    offset += value * factor
            if len(factors) > 1:  # (not within one window: each adapter's factor is the window's)
                summed = _sum([e for e in entries if isinstance(e[0], Tensor)])
                out.append((name, [summed], 1.0, offset))  # type: ignore[list-item]  # (a tensor)
            else:
                out.append((name, tensors, factors.pop() if factors else 1.0, offset))
        return out

    def read(self, extra: Sequence[Tensor] = ()) -> tuple[dict[str, float], list[float]]:
        """This rank's committed sums on the host, by name, each micro-batch's loss read as it is and summed
        exactly (``math.fsum``), and ``extra`` (device scalars: the gradient's norms) read with them: one stack,
        one host read."""
        layout = self.parts()
        tensors: list[Tensor] = []
        for _, parts, _, _ in layout:  # (a loop, not a comprehension: no function made at every window's end)
            tensors += parts
        values = host_values([*tensors, *extra])
        sums, start = {}, 0
        for name, parts, factor, offset in layout:
            end = start + len(parts)
            sums[name] = math.fsum(values[start:end]) * factor + offset
            start = end
        return sums, values[start:]

    def load_sums(self, names: Sequence[str], values: Sequence[float]) -> None:
        """Put back sums a checkpoint held (this rank's)."""
        self.clear()
        self._names, self._values = list(names), [float(v) for v in values]
        self._factors = [1.0] * len(self._values)
        self._committed = len(self._values)
        if len(self._names) != self._committed:
            raise ValueError(f"{len(self._names)} loss names for {self._committed} sums")

    def add_grad_norm(self, grads: Sequence[Tensor]) -> None:
        """Where the window's gradient is made global after its counts (the mixin under DDP): the
        normalised gradient (of one of the group's optimizers), before clipping."""
        if self.tracking:
            sq = squared_norm(grads)
            self._grad_sq = sq if self._grad_sq is None else self._grad_sq + sq.to(self._grad_sq.device)

    def grad_norm_on_device(self) -> Tensor | None:
        """What ``add_grad_norm`` measured, as a device scalar (``None`` if nothing)."""
        return None if self._grad_sq is None else self._grad_sq.sqrt()


def _sum(entries: Sequence[tuple[Tensor | float, float]]) -> Tensor | float:
    """The float64 sum of ``loss * factor`` over ``entries`` (one stack where they share a factor)."""
    numbers = [v * f for v, f in entries if not isinstance(v, Tensor)]
    tensors = [(v, f) for v, f in entries if isinstance(v, Tensor)]
    if not tensors:
        return sum(numbers)
    factors = {f for _, f in tensors}
    stacked = torch.stack([v.reshape(()).to(tensors[0][0].device, torch.float64) for v, _ in tensors])
    if len(factors) == 1:
        total = stacked.sum() * factors.pop()
    else:
        total = (stacked * torch.tensor([f for _, f in tensors], dtype=torch.float64, device=stacked.device)).sum()
    return total + sum(numbers) if numbers else total
