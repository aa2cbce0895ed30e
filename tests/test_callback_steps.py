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

from helpers import TokenData, TokenModel, loader, trainer


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
    callbacks: list[Any],
    module: type = pl.LightningModule,
    precision: Any = None,
    strategy: type = SingleDeviceStrategy,
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


class StopAt(pl.Callback):
    """Stops the fit at batch ``at`` (not a reader of the windows' numbers: no batch hook, no monitor)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.at:
            trainer.should_stop = True


def test_a_window_nobody_read_is_published_when_the_fit_stops_after_it() -> None:
    """Nobody reads the windows' numbers between the loggers' steps (no logger here), so a window in the middle of
    the epoch is not published; the fit stopped after it (``should_stop``), its numbers are the fit's latest."""
    t = trainer(callbacks=[AccumulationScheduler(2), StopAt(3)], max_epochs=1)
    t.fit(TokenModel(), loader(TokenData(32), 4))
    assert t.global_step == 2
    # (from the host counts: no loss was kept, nobody reading)
    assert t.callback_metrics["accum/k"] == 2 and t.callback_metrics["accum/samples"] == 16


class Skipping(TokenModel):
    """Returns no loss at the batches of ``skip``: Lightning runs no backward pass for them."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx in self.skip else super().training_step(batch, batch_idx)


def test_a_short_path_window_that_moved_nothing_is_not_counted_and_clipping_comes_back() -> None:
    """A plain window (its later batches on the hooks' short path) whose batches all return ``None``: its step moves
    nothing and Lightning does not count it, and gradient clipping, off for that step, is back for the next."""
    t = trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1, gradient_clip_val=0.5)
    with pytest.warns(UserWarning, match="not stepped"):
        t.fit(Skipping({3, 4, 5}), loader(TokenData(48), 4))
    assert t.global_step == 3  # (windows 0-2, 6-8 and 9-11; not 3-5)
    assert t.gradient_clip_val == 0.5
