"""The callback's small rules (issue 54): which batch takes the hooks' short path, and where autograd must mark a
backward pass's end, as table tests against the rule written out by hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_accum import AccumulationScheduler
from lightning_accum._trainer.recovery import before_with_own, pass_end_may_raise
from lightning_accum.callbacks.accumulation import takes_short_hooks


@pytest.mark.parametrize(
    ("plain", "factor", "loss_divisor", "divisor", "redo", "pending", "short"),
    [
        (True, 1.0, 4, 4, None, False, True),  # a plain aligned window's batch
        (False, 1.0, 4, 4, None, False, False),  # a fit with more to do (pieces, a budget, a mean, ...)
        (True, 0.5, 4, 4, None, False, False),  # the loss's gradient weighted (DeepSpeed's, a short last window)
        (True, 1.0, 4, 2, None, False, False),  # Lightning's stepping divisor goes back after the loss
        (True, 1.0, 4, 4, (0, 3), False, False),  # a batch a checkpoint holds, trained again
        (True, 1.0, 4, 4, None, True, False),  # a resumed window's gradient waits to be put back
        (True, 1.0, 1, 1, None, False, True),  # k = 1
    ],
)
def test_takes_short_hooks(
    plain: bool, factor: float, loss_divisor: int, divisor: int, redo: Any, pending: bool, short: bool
) -> None:
    assert takes_short_hooks(plain, factor, loss_divisor, divisor, redo, pending) is short


class OwnAfterBackward(pl.Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...


class OtherHooks(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None: ...


class OwnBackward(pl.LightningModule):
    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(loss, *args, **kwargs)


class UsersPrecision(Precision):
    def post_backward(self, tensor: Any, module: Any) -> Any:
        return super().post_backward(tensor, module)


class UsersStrategy(SingleDeviceStrategy):
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return super().backward(*args, **kwargs)


class DeepSpeedLike(SingleDeviceStrategy):
    """Named as DeepSpeed's strategy: its engine's backward runs the gradient's reduction after autograd's."""


ME = AccumulationScheduler(2)


def fake_trainer(
    callbacks: list[Any], module: type = pl.LightningModule, precision: Any = None, strategy: type = SingleDeviceStrategy
) -> Any:
    strategy_ = object.__new__(strategy)
    return SimpleNamespace(
        callbacks=callbacks,
        lightning_module=object.__new__(module),
        precision_plugin=precision or Precision(),
        strategy=strategy_,
    )


@pytest.mark.parametrize(
    ("trainer", "may_raise"),
    [
        (fake_trainer([ME]), False),  # nothing between the pass's end and the callback's hook
        (fake_trainer([OtherHooks(), ME, OwnAfterBackward()]), False),  # (listed after it: called after it)
        (fake_trainer([OwnAfterBackward(), ME]), True),  # Lightning calls that one first
        (fake_trainer([ME], module=OwnBackward), True),  # code after `loss.backward()`
        (fake_trainer([ME], precision=UsersPrecision()), True),
        (fake_trainer([ME], precision=MixedPrecision("16-mixed", "cpu")), False),  # Lightning's own AMP
        (fake_trainer([ME], strategy=UsersStrategy), True),
        (fake_trainer([ME], strategy=DDPStrategy), False),
        (fake_trainer([ME], strategy=DeepSpeedLike), True),
    ],
)
def test_pass_end_may_raise(trainer: Any, may_raise: bool) -> None:
    assert pass_end_may_raise(trainer, ME) is may_raise


def test_before_with_own() -> None:
    own, other = OwnAfterBackward(), OtherHooks()
    assert before_with_own([other, own, ME], ME, "on_after_backward")
    assert not before_with_own([other, ME, own], ME, "on_after_backward")
    assert not before_with_own([ME], ME, "on_after_backward")
