"""Misuse of ``AccumulationMixin``, caught where it happens: a module that is
not set up for it, an ``optimizer.step()`` or a ``self.manual_backward`` of the user's own inside
``training_step`` (its gradient would enter no window), an epoch of blocks without a backward pass."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_accum import _seam
from lightning_accum._lightning import rank_zero_warn


class MixinGuards:
    """Flags the mixin's driver sets around its own backward passes and steps, and the checks on them."""

    def __init__(self) -> None:
        self._in_pass = False  # inside the accumulator's own backward pass
        self._stepping = False  # inside the window-end `optimizer.step()`
        self.blocks = self.passes = 0  # this epoch's `accumulate` blocks, and their backward passes
        self._blocks_before = 0  # `blocks` when the batch under way started
        self._hooks: list[Any] = []

    def check_fit(self, module: Any, trainer: Any, driver: Any, configured: bool) -> None:
        if module.automatic_optimization:
            raise RuntimeError(
                "`AccumulationMixin` drives manual optimization, but `automatic_optimization` is True: remove "
                "`self.automatic_optimization = True`, or use the `AccumulationScheduler` callback instead."
            )
        if driver not in trainer.callbacks:
            raise RuntimeError(
                "The AccumulationMixin's callback is not attached: an override of `configure_callbacks` must "
                "include `super().configure_callbacks()` in what it returns."
            )
        if not configured:
            rank_zero_warn(
                f"`{type(module).__name__}` uses `AccumulationMixin` but never called `self.configure_accumulation"
                "(...)`, so every micro-batch is a window of its own (k = 1). Call it in `__init__` to accumulate."
            )

    def own_pass(self) -> contextlib.AbstractContextManager[None]:
        """A backward pass the accumulator makes, which the ``manual_backward`` guard lets through."""
        return self._while("_in_pass")

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """The mixin's own window-end ``optimizer.step()``, which the step guard lets through."""
        return self._while("_stepping")

    @contextlib.contextmanager
    def _while(self, flag: str) -> Iterator[None]:
        setattr(self, flag, True)
        try:
            yield
        finally:
            setattr(self, flag, False)

    def attach(self, optimizers: Sequence[Optimizer]) -> None:
        self._hooks = [o.register_step_pre_hook(self._refuse_user_step) for o in optimizers]

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._in_pass = self._stepping = False

    def _refuse_user_step(self, *_: Any) -> None:
        if not self._stepping:
            raise RuntimeError(
                "`optimizer.step()` was called inside `training_step`, but `AccumulationMixin` steps the optimizers "
                "itself when a window closes: remove the `optimizer.step()` (and `zero_grad()`) calls."
            )

    def check_manual_backward(self, module: Any) -> None:
        """Refuse a ``self.manual_backward`` the accumulator did not make during training."""
        if not self._in_pass and _seam.attached(module) and module.trainer.training:
            raise RuntimeError(
                "`self.manual_backward(loss)` was called directly, but with `AccumulationMixin` the backward passes "
                "go through the window: inside `with self.accumulate(batch) as acc:` call `acc.backward(loss)` "
                "(or `acc.backward_each` / `acc.backward_heads`)."
            )

    def block_opened(self) -> None:
        self.blocks += 1

    def passes_made(self, passes: int) -> None:
        self.passes += passes

    def batch_end(self, module: Any, outputs: Any, blocks_ran: bool) -> None:
        """Refuse a ``training_step`` that returned a loss (or anything) and ran no ``accumulate`` block, where
        no block ever ran before (``blocks_ran``: the model's windows exist): the automatic-optimization
        habit, with which nothing would ever be trained. A step that returns ``None`` (Lightning hands this
        hook ``{}`` then) skips its batch, as in Lightning's manual optimization; so does a step without a
        block in a model whose blocks already ran, whatever it returns."""
        ran = self.blocks != self._blocks_before
        self._blocks_before = self.blocks
        if ran or blocks_ran or outputs is None or (isinstance(outputs, Mapping) and not outputs):
            return
        keys = list(outputs) if isinstance(outputs, Mapping) else None
        what = "a loss" if keys == ["loss"] else f"a {type(outputs).__name__}" if keys is None else f"keys {keys}"
        raise RuntimeError(
            f"`{type(module).__name__}.training_step` returned {what} but ran no `with self.accumulate(batch) as "
            "acc:` block, so nothing was back-propagated or stepped (with `AccumulationMixin` the optimization is "
            "manual). Wrap the backward pass: `with self.accumulate(batch) as acc: acc.backward(loss)`; to skip "
            "a batch on purpose, return None from `training_step`."
        )

    def epoch_end(self) -> None:
        blocks, passes = self.blocks, self.passes
        self.blocks = self.passes = self._blocks_before = 0
        if blocks and not passes:
            raise RuntimeError(
                f"A whole epoch of `with self.accumulate(batch) as acc:` blocks ({blocks}) made no backward pass, so "
                "nothing was trained. Inside the block call `acc.backward(loss)` (or `acc.backward_each` / "
                "`acc.backward_heads`), not `loss.backward()`."
            )
