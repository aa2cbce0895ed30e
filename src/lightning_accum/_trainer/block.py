"""The open ``accumulate`` block: one micro-batch of a window group, what it counted, and its
backward passes under the sync plan (``Accumulator`` is the user's handle over it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_accum import multitask
from lightning_accum._core import gradients, sync
from lightning_accum._core.engine import WindowEngine
from lightning_accum._core.window import Window, check_count, microbatch_items, pass_items
from lightning_accum._trainer.guards import MixinGuards
from lightning_accum._trainer.windows import GroupKey, MixinWindows


class Block:
    """One ``with self.accumulate(batch) as acc:`` block.

    Attributes:
        key: the window group.
        engine, window: the group's engine and its open window.
        last: whether the window closes after this micro-batch (decided where first read: under a ``Budget``, from
            the count's all-reduce issued as the block opened, which the block's work overlaps until then).
        redoing: the micro-batch is one a checkpoint already holds (trained again, it adds nothing).
        passes: backward passes made so far.
    """

    def __init__(
        self,
        windows: MixinWindows,
        key: GroupKey,
        window: Window,
        *,
        last: Callable[[], bool],
        redoing: bool,
        counts: tuple[int, int | Tensor | None],
        plan: sync.SyncPlan,
        guards: MixinGuards,
    ) -> None:
        self.windows, self.key = windows, key
        self.engine: WindowEngine = windows.engines[key]
        self.window, self.redoing = window, redoing
        self._last: bool | Callable[[], bool] = last  # (the decision, until it is made)
        self._samples, self._counted = counts  # (counted before the block's code ran)
        self._items: int | Tensor | None = None  # what `items=` declared
        self._implicit = False  # a call declared no `items=` (`count(batch)` counts the micro-batch's, once)
        self._plan, self._guards = plan, guards
        self.passes = 0

    @property
    def last(self) -> bool:
        """Whether the window closes after this micro-batch (decided the first time it is read)."""
        if not isinstance(self._last, bool):
            self._last = self._last()
        return self._last

    @property
    def module(self) -> Any:
        return self.windows.module

    @property
    def strategy(self) -> Any:
        return self.module.trainer.strategy

    def params(self) -> list[Tensor]:
        """The group's parameters."""
        return self.windows.params(self.key)

    # ------------------------------------------------------------------ backward passes
    def _no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP: always no-sync (the window is all-reduced explicitly at its end). FSDP, FSDP2: sync skipped
        before the window's last micro-batch if planned."""
        if self._plan.family == "ddp":
            return sync.ddp_no_sync(self.strategy)
        if not self._plan.skip:  # (nothing skipped: the window's end is not needed before the block's end)
            return contextlib.nullcontext()
        return sync.skip_sync(self._plan, self.strategy, self.last)

    def backward(self, loss: Tensor, *, nothing: bool | Tensor = False) -> None:
        """``manual_backward(loss)`` into the window (``nothing``: the pass adds nothing to any gradient,
        NaN included, as a redone micro-batch's; a 0-d bool tensor: the same where it holds)."""
        self.passes += 1
        nothing = True if self.redoing else nothing
        handles = [] if nothing is False else gradients.add_nothing_if(self.windows.params(), nothing)
        try:
            with self._guards.own_pass(), self._no_sync():
                self.module.manual_backward(loss)
        finally:
            for handle in handles:
                handle.remove()

    def trunk_backward(self, features: Tensor | Sequence[Tensor], grad: Tensor | Sequence[Tensor]) -> None:
        """Back-propagate ``grad`` from ``features`` (a shared trunk's, or cached representations)."""
        self.passes += 1
        with self._no_sync():
            multitask._autograd_backward(features, grad)

    def uncounted(self) -> contextlib.AbstractContextManager[None]:
        """Where forwards add no BatchNorm statistics to the window (``batchnorm="window"``; else nothing)."""
        stats = self.engine.batchnorm
        return contextlib.nullcontext() if stats is None else stats.uncounted()

    def record_loss(self, loss: Tensor, name: str = "loss") -> None:
        """A pass's loss (before the window's division), or a task's, for the logged window loss."""
        if not self.redoing:
            self.engine.metrics.add_loss(loss, name)

    def weight(self, items: int | Tensor | None) -> int | Tensor | None:
        """A backward call of the block (``acc.backward``, ``backward_each``, ...) declares its items, and gets what
        its losses are weighted by (``window.pass_items``): its ``items=`` (a mean over them, added to the
        micro-batch's); else ``count(batch)`` under ``reduction="mean"`` (checked now, before any gradient is
        weighted by it); else ``None`` (a sum)."""
        if items is None:
            self._implicit = True
        else:
            self._items = items if self._items is None else self._items + items
        mean = self.windows.config.mean_items
        counted = self._counted
        if mean and items is None:
            counted = check_count(counted)
        return pass_items(items, mean, counted)

    def part_weight(self, part: Any) -> int | Tensor:
        """``count(part)`` of a part of the micro-batch (``backward_microbatches``, ``reduction="mean"``), checked."""
        count = self.windows.config.count
        assert count is not None, "reduction='mean' comes with `count`"
        return check_count(count(part), "`count(part)` of `backward_microbatches`")

    # ------------------------------------------------------------------ the block's end
    def finish(self, loss_scale: Callable[[], float]) -> None:
        """Count a micro-batch that back-propagated into the window (and the noise probe's prefix)."""
        last = self.last  # (decided before the micro-batch is counted: a budget's count over ranks goes in first)
        if not self.passes and not self.redoing:  # (its forwards ran: their BatchNorm statistics count all the same)
            self.engine.ran_without_backward()
        if self.redoing or not self.passes:  # (a micro-batch that back-propagated nothing does not count)
            return
        self._guards.passes_made(self.passes)
        engine = self.engine
        engine.count(self._samples, self._item_count())
        engine.backward_done()
        self.window.mark_synced(last)
        if not last and engine.wants_prefix():
            engine.measure_prefix(gradients.grads_of(self.params()), loss_scale())

    def _item_count(self) -> int | Tensor:
        if self._items is None and self._counted is None and self.windows.config.normalize == "items":
            raise ValueError(
                "`normalize='items'` needs the micro-batch's item count: give `count=` to "
                "`configure_accumulation`, or call `acc.backward(loss, items=n)`."
            )
        return microbatch_items(self._items, self._implicit, self._counted, self._samples)
