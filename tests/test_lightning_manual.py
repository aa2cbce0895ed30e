"""Lightning's manual-optimization contracts, on the mixin: a model written for them trains as it does
under Lightning, or is refused before its first step with the fix.

Lightning's own tests of manual optimization (``tests_pytorch/trainer/optimization/
test_manual_optimization.py``) rewritten here for the mixin: the model steps its LR schedulers (Lightning
steps none: ``test_lr_schedulers``, ``test_lr_schedulers_reduce_lr_on_plateau``,
``test_lr_scheduler_step_not_called``), a step may skip its batch (``ManualOptimizationExtendedModel``),
every optimizer's step counts in ``global_step`` (``test_multiple_optimizers_manual_call_counts``), and
``optimizer.step(closure)`` (``test_step_with_optimizer_closure``), which the mixin cannot honour, is refused
at once. The reference is Lightning itself: the same model written with ``manual_backward`` and
``optimizer.step()`` by hand.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_accum import AccumulationMixin

from helpers import Batch, TokenData, loader, make_net, max_diff, params_of, token_losses, trainer

DATA = TokenData(32)  # 8 batches of 4


def sgd(module: pl.LightningModule, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=lr)


def step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class ByHand(pl.LightningModule):
    """Lightning's manual optimization, accumulation written by hand: windows of ``k`` batches (the last of an
    epoch may be shorter), the scheduler stepped where ``stepping`` says (``"window"``: with the optimizer;
    ``"batch"``: every batch; ``"epoch"``: in ``on_train_epoch_end``), ``skip``: batches that train nothing."""

    def __init__(self, k: int = 2, stepping: str = "window", skip: Any = None, lr: float = 0.1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net, self.k, self.stepping, self.skip, self.lr = make_net(), k, stepping, skip, lr
        self.in_window = 0

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        if self.skip is not None and self.skip(batch_idx):
            return None
        total, tokens = token_losses(self.net, batch)
        self.manual_backward(total / tokens / self.k)
        self.in_window += 1
        batches = int(self.trainer.num_training_batches)
        last = all(self.skip is not None and self.skip(j) for j in range(batch_idx + 1, batches))  # (the epoch's last)
        if self.in_window == self.k or last:
            for p in self.net.parameters():  # a short last window is a mean over its own batches
                p.grad.mul_(self.k / self.in_window)
            self.optimizers().step()
            self.optimizers().zero_grad()
            self.in_window = 0
            if self.stepping == "window":
                self.lr_schedulers().step()
        if self.stepping == "batch":
            self.lr_schedulers().step()
        return None

    def on_train_epoch_end(self) -> None:
        if self.stepping == "epoch":
            self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        optimizer = sgd(self, self.lr)
        interval = "epoch" if self.stepping == "epoch" else "step"  # (what the mixin steps with `step_schedulers`)
        return [optimizer], [{"scheduler": step_lr(optimizer), "interval": interval}]


class WithMixin(AccumulationMixin, ByHand):
    """The same model on the mixin: the backward in an ``accumulate`` block, the scheduler stepped by the model
    where ``ByHand`` steps it (``"window"``: after the block when ``acc.last``)."""

    def __init__(self, k: int = 2, stepping: str = "window", skip: Any = None, lr: float = 0.1, **options: Any) -> None:
        super().__init__(k, stepping, skip, lr)
        self.configure_accumulation(k, **options)

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        if self.skip is not None and self.skip(batch_idx):
            return None
        total, tokens = token_losses(self.net, batch)
        with self.accumulate(batch) as acc:
            acc.backward(total / tokens)
        if self.stepping == "window" and acc.last:
            self.lr_schedulers().step()
        if self.stepping == "batch":
            self.lr_schedulers().step()
        return None


def fit(model: pl.LightningModule, epochs: int = 1, **kwargs: Any) -> pl.Trainer:
    t = trainer(max_epochs=epochs, **kwargs)
    t.fit(model, loader(DATA, 4))
    return t


# ---------------------------------------------------------------------- the model steps its schedulers
@pytest.mark.parametrize(("stepping", "epochs", "steps"), [("window", 1, 4), ("batch", 1, 8), ("epoch", 2, 2)])
def test_a_scheduler_the_model_steps_trains_as_under_lightning(stepping: str, epochs: int, steps: int) -> None:
    """The issue's models: a StepLR stepped once per window (8 batches, k = 2: 4 steps), every batch (8), or in
    `on_train_epoch_end` (2 epochs: 2). Before, the mixin stepped it too: `last_epoch` 12, LR 2.4e-5 instead of
    0.1 * 0.5^4; 0.0625 instead of 0.25 after 2 epochs."""
    lightning, mixin = ByHand(stepping=stepping), WithMixin(stepping=stepping, step_schedulers=False)
    t_lightning, t_mixin = fit(lightning, epochs), fit(mixin, epochs)
    for t in (t_lightning, t_mixin):
        assert t.lr_scheduler_configs[0].scheduler.last_epoch == steps
        assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**steps, rel=1e-15)
    assert t_mixin.global_step == t_lightning.global_step == 4 * epochs
    assert max_diff(params_of(mixin), params_of(lightning)) <= 1e-15


def test_the_default_says_who_steps_the_schedulers() -> None:
    with pytest.warns(UserWarning, match=r"has LR schedulers \(StepLR\) .* leaves them to the model .*step_schedulers"):
        fit(WithMixin())


class ChecksSchedulers(AccumulationMixin, pl.LightningModule):
    """Lightning's `test_lr_schedulers`, unchanged: `lr_schedulers()` in the order configured, no backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        first, second = self.lr_schedulers()  # type: ignore[misc]
        assert first is self.first and second is self.second

    def configure_optimizers(self) -> Any:
        one, two = sgd(self), sgd(self)
        self.first, self.second = step_lr(one), step_lr(two)
        return [one, two], [self.first, self.second]


def test_lr_schedulers_in_the_order_configured() -> None:
    t = fit(ChecksSchedulers(), limit_train_batches=1)
    assert t.global_step == 0 and [c.scheduler.last_epoch for c in t.lr_scheduler_configs] == [0, 0]


class PlateauByTheModel(WithMixin):
    """Lightning's `test_lr_schedulers_reduce_lr_on_plateau`: a bare ReduceLROnPlateau (no monitor), or one in a
    dict with `monitor` and `interval="step"`, stepped by the model in `on_train_epoch_end`."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__(stepping="none", step_schedulers=False)
        self.as_dict = as_dict

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step(torch.tensor(0.0))  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        optimizer = sgd(self)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        config = {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}
        return [optimizer], [config if self.as_dict else plateau]


@pytest.mark.parametrize("as_dict", [True, False])
def test_plateau_stepped_by_the_model(as_dict: bool) -> None:
    if as_dict:
        with pytest.warns(RuntimeWarning, match=r"\['monitor'\], but the keys will be ignored"):  # (Lightning's)
            t = fit(PlateauByTheModel(as_dict), epochs=2)
        assert t.lr_scheduler_configs[0].interval == "step"
    else:
        t = fit(PlateauByTheModel(as_dict), epochs=2)
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 2  # once an epoch, by the model alone


def test_lr_scheduler_step_not_called_by_the_mixin() -> None:
    """Lightning's `test_lr_scheduler_step_not_called`: once, in the scheduler's constructor."""
    with mock.patch("torch.optim.lr_scheduler.StepLR.step") as lr_step:
        fit(WithMixin(stepping="none", step_schedulers=False), fast_dev_run=2)
    assert lr_step.call_count == 1


# ---------------------------------------------------------------------- ... or the mixin, and then only it
class StepsItsOwn(WithMixin):
    """`step_schedulers=True`, and the model steps the scheduler too: ``where``."""

    def __init__(self, where: str) -> None:
        super().__init__(stepping="window" if where == "after the block" else "none", step_schedulers=True)
        self.where = where
        self.lrs: list[float] = []

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        if self.where == "before the block" and batch_idx == 1:
            self.lr_schedulers().step()  # type: ignore[union-attr]
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        if self.where == "in on_train_epoch_end":
            self.lr_schedulers().step()  # type: ignore[union-attr]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize(
    ("where", "steps"), [("before the block", 0), ("after the block", 1), ("in on_train_epoch_end", 4)]
)  # fmt: skip
def test_the_models_own_step_under_step_schedulers_is_refused(where: str, steps: int) -> None:
    """Refused before any optimizer step uses the LR it changed: each step taken used the mixin's schedule."""
    model = StepsItsOwn(where)
    t = trainer(max_epochs=2)
    with pytest.raises(RuntimeError, match=r"`StepLR` was stepped by the model .*step_schedulers=True.*Remove"):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == steps
    assert model.lrs == [0.1 * 0.5**i for i in range(steps)]


def test_the_mixin_steps_them_as_lightnings_automatic_loop() -> None:
    """`step_schedulers=True`: one step per window, the LR of each step as Lightning's automatic loop gives."""
    mixin = WithMixin(stepping="none", step_schedulers=True)
    t = fit(mixin, epochs=2)
    lightning = ByHand(stepping="window")
    fit(lightning, epochs=2)
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 8
    assert max_diff(params_of(mixin), params_of(lightning)) <= 1e-15


# ---------------------------------------------------------------------- skipped batches
def every_other(batch_idx: int) -> bool:
    return batch_idx % 2 == 1


@pytest.mark.parametrize("skip", [every_other, lambda i: i % 2 == 0], ids=["odd", "even, the first included"])
@pytest.mark.parametrize("k", [1, 2])
def test_a_step_returning_none_skips_its_batch(skip: Any, k: int) -> None:
    """Lightning hands `on_train_batch_end` `{}` for a step that returns None in manual optimization; the guard
    refused it ("returned a loss but ran no ... block")."""
    lightning, mixin = ByHand(k=k, skip=skip, stepping="none"), WithMixin(k=k, skip=skip, stepping="none")
    outputs: list[Any] = []

    class Outputs(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, out: Any, *args: Any) -> None:
            outputs.append(out)

    fit(lightning, epochs=2)
    t = fit(mixin, epochs=2, callbacks=[Outputs()])
    assert outputs[:2] == [{}, {}]
    if k == 1:  # (ByHand's windows count loader batches, the mixin's blocks: the same for k = 1)
        assert t.global_step == 8
        assert max_diff(params_of(mixin), params_of(lightning)) <= 1e-15
    else:
        assert t.global_step == 4  # 4 blocks an epoch, in windows of 2


def test_a_window_is_cut_at_the_epochs_end_when_its_last_batches_are_skipped() -> None:
    """Before: a window the epoch's last batch ran no block of stayed open into the next epoch."""
    skip = lambda i: i >= 6  # noqa: E731  (of 8 batches; windows of 4: the epoch's second window holds 2)
    lightning, mixin = ByHand(k=4, skip=skip, stepping="none"), WithMixin(k=4, skip=skip, stepping="none")
    sizes: list[int] = []

    class Sizes(pl.Callback):
        def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: Any) -> None:
            sizes.append(window.microbatches)

    fit(lightning, epochs=2)
    t = fit(mixin, epochs=2, callbacks=[Sizes()])
    assert sizes == [4, 2, 4, 2] and t.global_step == 4
    assert max_diff(params_of(mixin), params_of(lightning)) <= 1e-15


class ReturnsItsLossAlways(WithMixin):
    """Lightning's `ManualOptimizationExtendedModel`: trains on every other batch, returns the loss on each."""

    def __init__(self, first: bool) -> None:
        super().__init__(k=1, stepping="none", skip=None, step_schedulers=False)
        self.first = first

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        total, tokens = token_losses(self.net, batch)
        if (batch_idx % 2 == 0) == self.first:
            with self.accumulate(batch) as acc:
                acc.backward(total / tokens)
        return total / tokens


def test_a_loss_returned_on_a_skipped_batch_after_the_first_block() -> None:
    model = ReturnsItsLossAlways(first=True)
    t = fit(model)
    lightning = ByHand(k=1, skip=every_other, stepping="none")
    fit(lightning)
    assert t.global_step == 4 and max_diff(params_of(model), params_of(lightning)) <= 1e-15


def test_a_loss_returned_without_any_block_yet_is_refused_before_the_first_step() -> None:
    model = ReturnsItsLossAlways(first=False)  # (the first batch skipped, returning its loss)
    before = params_of(model)
    t = trainer(max_epochs=1)
    refused = r"returned a loss but ran no `with self.accumulate\(batch\) as acc:` block.*return None"
    with pytest.raises(RuntimeError, match=refused):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == 0 and max_diff(params_of(model), before) == 0.0


# ---------------------------------------------------------------------- several optimizers, closures
class TwoOnOneLayer(AccumulationMixin, pl.LightningModule):
    """Lightning's `ManualOptModel`: two SGDs over the same layer; here both in the one shared window."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        total, tokens = token_losses(self.net, batch)
        with self.accumulate(batch) as acc:
            acc.backward(total / tokens)
        return total.detach()

    def configure_optimizers(self) -> Any:
        return sgd(self), sgd(self)


def test_every_optimizers_step_counts_in_global_step() -> None:
    """Lightning's `test_multiple_optimizers_manual_call_counts`: `global_step == batches * 2`."""
    t = fit(TwoOnOneLayer(), limit_train_batches=2)
    assert t.global_step == 2 * 2


class StepsWithAClosure(WithMixin):
    """Lightning's `test_step_with_optimizer_closure`: `opt.step(closure=...)` inside `training_step`."""

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        def closure() -> None:
            with self.accumulate(batch) as acc:
                acc.backward(token_losses(self.net, batch)[0])

        self.optimizers().step(closure=closure)  # type: ignore[union-attr]


def test_a_step_with_a_closure_is_refused_before_it_runs() -> None:
    model = StepsWithAClosure(stepping="none", step_schedulers=False)
    before = params_of(model)
    with pytest.raises(RuntimeError, match=r"`optimizer.step\(\)` was called inside `training_step`.*remove"):
        fit(model)
    assert max_diff(params_of(model), before) == 0.0
