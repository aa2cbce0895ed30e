"""Misuse of ``AccumulationMixin``, caught where it happens: a module that is
not set up for it, an ``optimizer.step()`` or a ``self.manual_backward`` of the user's own inside
``training_step`` (its gradient would enter no window), an epoch of blocks without a backward pass."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from lightning_accum import _seam
from lightning_accum._lightning import builtin_callbacks, rank_zero_warn

TUNED = {"BatchSizeFinder": "batch size", "LearningRateFinder": "learning rate"}


def refuse_callbacks(module: Any, callbacks: Sequence[Any]) -> None:
    """Lightning callbacks the mixin cannot run beside, refused as a fit sets up (before any batch): the tuners,
    whose trial steps run without the Trainer's callbacks (the mixin's own among them), and
    ``StochasticWeightAveraging`` with BatchNorm layers, whose last epoch must run forward passes only."""
    for name, what in TUNED.items():
        if any(isinstance(cb, builtin_callbacks(name)) for cb in callbacks):
            raise RuntimeError(
                f"`{name}` runs its trial steps with the Trainer's callbacks taken away, the `AccumulationMixin`'s "
                f"own among them, so `self.accumulate` cannot run there. Search with the `AccumulationScheduler` "
                f"callback (automatic optimization, where `{name}` works), or set the {what} by hand, and fit "
                f"`{type(module).__name__}` without `{name}`."
            )
    swa = any(isinstance(cb, builtin_callbacks("StochasticWeightAveraging")) for cb in callbacks)
    if swa and any(isinstance(m, _BatchNorm) for m in module.modules()):
        raise RuntimeError(
            "`StochasticWeightAveraging` with BatchNorm layers adds a last epoch that recomputes their running "
            "statistics with forward passes only (Lightning skips the backward pass in automatic optimization), "
            "but an `AccumulationMixin` model's `training_step` back-propagates and steps there, moving the "
            "averaged weights. Use the `AccumulationScheduler` callback (automatic optimization), a model without "
            "BatchNorm, or update the statistics after the fit yourself (`torch.optim.swa_utils.update_bn`)."
        )


class MixinGuards:
    """Flags the mixin's driver sets around its own backward passes and steps, and the checks on them."""

    def __init__(self) -> None:
        self._in_pass = False  # inside the accumulator's own backward pass
        self._stepping = False  # inside the window-end `optimizer.step()`
        self._resetting = False  # inside the mixin's own `zero_grad`
        self.blocks = self.passes = 0  # this epoch's `accumulate` blocks, and their backward passes
        self._blocks_before = 0  # `blocks` when the batch under way started
        self._hooks: list[Any] = []
        self._in_batch = False  # from the driver's `on_train_batch_start` to its `on_train_batch_end`
        self._windows_open: Callable[[], bool] | None = None  # while attached: whether a window holds micro-batches
        self._unguard: Callable[[], None] = _nothing  # takes the optimizers' `zero_grad` guards back
        # windows of some optimizers: id -> name of the parameters the block under way must not reach (None: any)
        self._outside: dict[int, str] | None = None
        self._outside_of: dict[tuple[int, ...], dict[int, str]] = {}  # per window group, for this fit
        self._leak_hooks: list[Any] = []  # on the optimizers' parameters, once a window of some of them ran

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

    def attach(
        self, optimizers: Sequence[Optimizer], wrappers: Sequence[Any] = (), windows_open: Callable[[], bool] = bool
    ) -> None:
        """At train start: refuse a step of ``optimizers`` the mixin does not take, and a ``zero_grad`` of them or
        of their Lightning ``wrappers`` (``windows_open``: whether a window holds micro-batches) it does not make."""
        self._hooks = [o.register_step_pre_hook(self._refuse_user_step) for o in optimizers]
        self._windows_open = windows_open
        self._unguard = _seam.guard_zero_grad(wrappers, self.check_zero_grad)

    def detach(self) -> None:
        for hook in self._hooks + self._leak_hooks:
            hook.remove()
        self._hooks, self._leak_hooks, self._outside, self._outside_of = [], [], None, {}
        self._unguard()
        self._unguard, self._windows_open = _nothing, None
        self._in_pass = self._stepping = self._resetting = self._in_batch = False

    def batch_start(self) -> None:
        self._in_batch = True

    def check_zero_grad(self) -> None:
        """Refuse a ``zero_grad()`` (of an optimizer, or ``self.zero_grad()``) the mixin does not make, during a
        training batch or while a window holds micro-batches: it would throw the window's gradient away, silently
        (the mixin resets the gradients itself when a window closes). Elsewhere (before the fit's first batch,
        between windows in an epoch's hooks, after the fit) it is the user's to make."""
        windows_open = self._windows_open
        if self._stepping or self._resetting or windows_open is None or not (self._in_batch or windows_open()):
            return
        raise RuntimeError(
            "`zero_grad()` was called during training (`self.optimizers().zero_grad()`, `optimizer.zero_grad()` or "
            "`self.zero_grad()`, e.g. left in `training_step` from Lightning's manual optimization), but "
            "`AccumulationMixin` resets the gradients itself when a window closes, and a `zero_grad` inside a window "
            "throws its micro-batches away: remove the call."
        )

    def resetting(self) -> contextlib.AbstractContextManager[None]:
        """A ``zero_grad`` the mixin makes (at a window's end, before validation), which the guard lets through."""
        return self._while("_resetting")

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

    def block_opened(
        self,
        key: tuple[int, ...],
        own: Callable[[], Sequence[Tensor]],
        every: Sequence[Tensor],
        names: Callable[[], Mapping[int, str]],
    ) -> None:
        """An ``accumulate`` block of window group ``key`` opens: for a window of some of the optimizers (``own``:
        their parameters; ``every``: all the optimizers' parameters, empty where not watched), its backward passes
        must reach no other optimizer's parameter (``names``: id -> name), whose window would take the gradient."""
        self.blocks += 1
        if not every:
            return
        outside = self._outside_of.get(key)
        if outside is None:
            if not self._leak_hooks:
                self._leak_hooks = [_post_accumulate_hook(p, self._refuse_leak) for p in every]
            mine, named = {id(p) for p in own()}, names()
            outside = self._outside_of[key] = {id(p): named.get(id(p), "?") for p in every if id(p) not in mine}
        self._outside = outside

    def block_exited(self) -> None:
        self._outside = None

    def _refuse_leak(self, param: Tensor) -> None:
        outside = self._outside
        if outside is None or id(param) not in outside:
            return
        raise RuntimeError(
            f"A backward pass of a window of its own (`self.accumulate(batch, optimizer=...)`) reached "
            f"`{outside[id(param)]}`, a parameter of another optimizer, whose window would take that gradient "
            "(Lightning's manual optimization hides it with the `zero_grad()` before each optimizer's backward, "
            "which the mixin does not make). Keep each pass to its optimizer's parameters: "
            "`self.toggle_optimizer(opt)` before the block and `self.untoggle_optimizer(opt)` after it (a GAN's "
            "generator pass through the discriminator), or detach what the other optimizer's modules give; or "
            "accumulate them in one window (`self.accumulate(batch)`)."
        )

    def passes_made(self, passes: int) -> None:
        self.passes += passes

    def batch_end(self, module: Any, outputs: Any, blocks_ran: bool) -> None:
        """Refuse a ``training_step`` that returned a loss (or anything) and ran no ``accumulate`` block, where
        no block ever ran before (``blocks_ran``: the model's windows exist): the automatic-optimization
        habit, with which nothing would ever be trained. A step that returns ``None`` (Lightning hands this
        hook ``{}`` then) skips its batch, as in Lightning's manual optimization; so does a step without a
        block in a model whose blocks already ran, whatever it returns."""
        self._in_batch = False
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
        self._in_batch = False  # (a batch whose `on_train_batch_start` returned -1 ran no batch end)
        blocks, passes = self.blocks, self.passes
        self.blocks = self.passes = self._blocks_before = 0
        if blocks and not passes:
            raise RuntimeError(
                f"A whole epoch of `with self.accumulate(batch) as acc:` blocks ({blocks}) made no backward pass, so "
                "nothing was trained. Inside the block call `acc.backward(loss)` (or `acc.backward_each` / "
                "`acc.backward_heads`), not `loss.backward()`."
            )


def _nothing() -> None:
    return None


def _post_accumulate_hook(param: Tensor, hook: Callable[[Tensor], None]) -> Any:
    """``param.register_post_accumulate_grad_hook(hook)``, also on a parameter whose ``requires_grad`` is off now
    (``toggle_optimizer`` turned it off; the hook stays when it is turned on again)."""
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
    param.requires_grad_(True)
    try:
        return param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
    finally:
        param.requires_grad_(False)
