"""Where the mixin meets Lightning's contracts (the adversarial pass after issue 31): a step-interval
``ReduceLROnPlateau`` stepped where Lightning's automatic loop steps it, a fit stopped inside a window, a
``zero_grad()`` left in ``training_step``, a pass of one optimizer's window into another's parameters, the
``on_window_end`` hooks refused at the start, ``estimated_stepping_batches`` with several optimizers, and the
scheduler steps the documented idioms give. The references are Lightning itself (the same model written for
its automatic loop, or for manual optimization by hand) or the float64 loop of ``tests/helpers.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_accum
from lightning_accum import AccumulationMixin, AccumulationScheduler, Constant, WindowReport

from helpers import (
    Batch,
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenData,
    loader,
    make_net,
    max_diff,
    params_of,
    rank_batches,
    token_losses,
)
from helpers import trainer as make_trainer

DATA = TokenData(32)  # 8 batches of 4
BATCHES = rank_batches(DATA, 4)[0]


def trainer(**kwargs: Any) -> pl.Trainer:
    return make_trainer(**{"max_epochs": 1, **kwargs})


def mean_loss(net: nn.Module, batch: Batch) -> Tensor:
    total, tokens = token_losses(net, batch)
    return total / tokens


# ---------------------------------------------------------------------- a step plateau, where Lightning steps it
class Seen(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """Records each value it is stepped with."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, patience=0, factor=0.5)
        self.seen: list[float] = []

    def step(self, metrics: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.seen.append(float(metrics))
        super().step(metrics, *args, **kwargs)


class AutomaticPlateau(pl.LightningModule):
    """Lightning's automatic loop: the training loss logged in `training_step` (or after the batch, or a
    validation loss), a step-interval plateau on it."""

    def __init__(self, monitor: str = "train_loss", strict: bool = True) -> None:
        super().__init__()
        self.net, self.monitor, self.strict = make_net(), monitor, strict

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = mean_loss(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        self.log("after_batch", mean_loss(self.net, batch))  # (at the stepped weights)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("val_loss", mean_loss(self.net, batch))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.plateau = Seen(optimizer)
        config = {"scheduler": self.plateau, "interval": "step", "monitor": self.monitor, "strict": self.strict}
        return [optimizer], [config]


class MixinPlateau(AccumulationMixin, AutomaticPlateau):
    """The same model on the mixin, `step_schedulers=True`: the loss logged after the block."""

    def __init__(self, k: int, monitor: str = "train_loss", strict: bool = True) -> None:
        super().__init__(monitor, strict)
        self.configure_accumulation(k, step_schedulers=True)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            loss = mean_loss(self.net, batch)
            acc.backward(loss)
        self.log("train_loss", loss)  # (after the block: the window has stepped already)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("monitor", ["train_loss", "after_batch", "val_loss"])
def test_a_step_plateau_sees_what_lightnings_loop_shows_it(k: int, monitor: str) -> None:
    """Before, the mixin stepped it as the block exited: `train_loss` was refused at the first window ("not
    logged") with `strict=True`, one batch old with `strict=False`, and a validation loss missed (6e-2)."""
    options: dict[str, Any] = {"val_check_interval": 3, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    strict = monitor != "val_loss"
    automatic, mixin = AutomaticPlateau(monitor, strict), MixinPlateau(k, monitor, strict)
    trainer(accumulate_grad_batches=k, **options).fit(automatic, loader(DATA, 4), loader(DATA, 4))
    t = trainer(**options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (`val_loss` is not there before the first validation)
        t.fit(mixin, loader(DATA, 4), loader(DATA, 4))
    assert len(mixin.plateau.seen) >= 8 // k - 2
    assert mixin.plateau.seen == pytest.approx(automatic.plateau.seen, rel=1e-15, abs=0)
    assert max_diff(params_of(mixin), params_of(automatic)) <= 1e-15


def test_a_missing_plateau_metric_is_warned_about_and_skipped_without_strict() -> None:
    """As Lightning's loop: with `"strict": False` a plateau whose metric is not there skips its step, and says so."""
    model = MixinPlateau(1, monitor="never_logged", strict=False)
    with pytest.warns(RuntimeWarning, match=r"monitors 'never_logged', which is not in .*skipped"):
        trainer().fit(model, loader(DATA, 4))
    assert model.plateau.seen == []
    with pytest.raises(RuntimeError, match=r"monitors 'never_logged', which is not in .*after the batch's"):
        trainer().fit(MixinPlateau(1, monitor="never_logged"), loader(DATA, 4))


# ---------------------------------------------------------------------- a fit stopped inside a window
class Interrupted(Exception):
    pass


class Model(AccumulationMixin, pl.LightningModule):
    """Windows of ``k``; stops the loop after batch ``stop`` (``how``) of the first epoch of its first fit."""

    def __init__(self, k: int = 3, stop: int | None = None, how: str = "should_stop", **options: Any) -> None:
        super().__init__()
        self.net, self.stop, self.how = make_net(), stop, how
        self.configure_accumulation(k, **options)
        self.windows: list[tuple[int, int]] = []

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if self.how == "exception" and batch_idx == self.stop:
            self.stop = None
            raise Interrupted  # (the fit fails inside the window)
        with self.accumulate(batch) as acc:
            acc.backward(mean_loss(self.net, batch))

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> int | None:
        if self.how == "skip_rest" and batch_idx == self.stop:
            self.stop = None
            return -1  # (the rest of the epoch is skipped; the next epoch trains)
        return None

    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        if self.how == "should_stop" and batch_idx == self.stop:
            self.stop = None
            self.trainer.should_stop = True

    def on_window_end(self, window: WindowReport) -> None:
        self.windows.append((window.k, window.microbatches))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["should_stop", "exception"])
def test_a_fit_stopped_inside_a_window_leaves_nothing_to_the_next(how: str) -> None:
    """Stopped after batch 4 with k = 3, the window of batches 3 and 4 stayed open: the next `trainer.fit` counted
    them as its first window's first micro-batches (a window of 3 closed after 1 new batch, gradients at the old
    weights). Now it is dropped: the first fit trained one window, the second a whole epoch from there."""
    model = Model(stop=4, how=how)
    if how == "exception":
        with pytest.raises(Interrupted):
            trainer().fit(model, loader(DATA, 4))
    else:
        trainer().fit(model, loader(DATA, 4))
    assert model.windows == [(3, 3)]
    model.windows.clear()
    trainer().fit(model, loader(DATA, 4))
    assert model.windows == [(3, 3), (3, 3), (3, 2)]
    want, _ = Reference(Constant(3), optimizer="plain-sgd").run([[BATCHES[:3]], [BATCHES]])
    assert max_diff(params_of(model), want) <= 1e-15
    assert model.accumulation_progress.step == 4  # (the model keeps its progress across fits, as its weights)


def test_an_epoch_cut_short_drops_its_open_window_and_the_next_epoch_trains() -> None:
    """`on_train_batch_start` returning -1 ends the epoch before its last batch: Lightning's automatic loop
    drops the open window (its next zero_grad); before, the mixin carried it into the next epoch."""

    class ZeroesAtEpochStart(Model):
        def on_train_epoch_start(self) -> None:
            self.zero_grad()  # (no window is open: the model's to make, after a batch start that returned -1 too)

    model = ZeroesAtEpochStart(stop=5, how="skip_rest")
    trainer(max_epochs=2).fit(model, loader(DATA, 4))
    assert model.windows == [(3, 3), (3, 3), (3, 3), (3, 2)]
    want, _ = Reference(Constant(3), optimizer="plain-sgd").run([[BATCHES[:3]], [BATCHES]])
    assert max_diff(params_of(model), want) <= 1e-15


class Automatic(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.fail = make_net(), True

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        if self.fail and batch_idx == 4:
            self.fail = False
            raise Interrupted
        return mean_loss(self.net, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def test_the_callback_refit_after_a_failure_inside_a_window_starts_afresh() -> None:
    """The same with `AccumulationScheduler` reused by the next fit: the failed window's micro-batch was counted
    into the next fit's first window (4 micro-batches, normalised by 4)."""
    model, callback, sizes = Automatic(), AccumulationScheduler(3), []

    class Sizes(pl.Callback):
        def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: WindowReport) -> None:
            sizes.append(window.microbatches)

    with pytest.raises(Interrupted):
        trainer(callbacks=[callback, Sizes()]).fit(model, loader(DATA, 4))
    sizes.clear()
    trainer(callbacks=[callback, Sizes()]).fit(model, loader(DATA, 4))
    assert sizes == [3, 3, 2]
    want, _ = Reference(Constant(3), optimizer="plain-sgd").run([[BATCHES[:3]], [BATCHES]])
    assert max_diff(params_of(model), want) <= 1e-15


def test_a_checkpoint_written_inside_a_window_still_resumes_it(tmp_path: Any) -> None:
    """What the refit drops is only what no checkpoint restored: a resume from inside a window continues it."""
    path = tmp_path / "inside.ckpt"

    class SaveAt4(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.fit_loop.epoch_loop.batch_idx == 4 and trainer.current_epoch == 0:
                trainer.save_checkpoint(path)

    whole = Model()
    trainer(max_epochs=2, callbacks=[SaveAt4()]).fit(whole, ResumableLoader(DATA, 4))
    resumed = Model()
    trainer(max_epochs=2).fit(resumed, ResumableLoader(DATA, 4), ckpt_path=path)
    assert max_diff(params_of(resumed), params_of(whole)) <= 1e-15


# ---------------------------------------------------------------------- zero_grad left in training_step
class ZeroesToo(Model):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.zeroing = how

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if self.zeroing == "self.optimizers()":
            self.optimizers().zero_grad()  # type: ignore[union-attr]
        elif self.zeroing == "trainer.optimizers":
            self.trainer.optimizers[0].zero_grad()
        elif self.zeroing == "self.zero_grad()":
            self.zero_grad()
        super().training_step(batch, batch_idx)

    def on_train_epoch_start(self) -> None:
        if self.zeroing == "at the epoch's start":  # (no window is open: the model's to make)
            self.optimizers().zero_grad()  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["self.optimizers()", "trainer.optimizers", "self.zero_grad()"])
def test_a_zero_grad_left_in_training_step_is_refused_before_anything_changes(how: str) -> None:
    """Before, it threw each window's earlier micro-batches away, silently (5e-2 off)."""
    model = ZeroesToo(how)
    before = params_of(model)
    t = trainer()
    with pytest.raises(RuntimeError, match=r"`zero_grad\(\)` was called during training .*remove the call"):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == 0 and max_diff(params_of(model), before) == 0.0
    optimizer = t.optimizers[0]
    assert "zero_grad" not in vars(optimizer) and "zero_grad" not in vars(t.strategy._lightning_optimizers[0])


@pytest.mark.parametrize("reset", ["zero", "none"])
def test_zero_grads_outside_windows_are_the_models_and_the_mixins_own_pass(reset: str) -> None:
    """At an epoch's start (no window open), Lightning's own (the fit's start, before validation), the mixin's
    `reset="none"` (`zero_grad(set_to_none=True)`): none is refused, and the windows are the reference's."""
    model = ZeroesToo("at the epoch's start")
    model.configure_accumulation(3, reset=reset)  # type: ignore[arg-type]
    t = trainer(max_epochs=2, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model, loader(DATA, 4), loader(DATA, 4))
    want, _ = Reference(Constant(3), optimizer="plain-sgd").run([[BATCHES]] * 2)
    assert max_diff(params_of(model), want) <= 1e-15
    model.zero_grad()  # (after the fit: the user's)


# ---------------------------------------------------------------------- windows of their own, passes into another's
class LightningGAN(pl.LightningModule):
    """Lightning's manual-optimization GAN pattern without a toggle: the `zero_grad()` before each backward keeps
    the generator's pass out of the discriminator's gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.g, self.d = nn.Linear(3, 3).double(), nn.Linear(3, 1).double()
        self.automatic_optimization = False

    def losses(self, batch: Batch) -> tuple[Any, Any]:
        x, y = batch["x"][:, 0], batch["y"][:, 0]
        return lambda: F.mse_loss(self.d(self.g(x)), y), lambda: F.mse_loss(self.d(x), y)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        g_loss, d_loss = self.losses(batch)
        og, od = self.optimizers()  # type: ignore[misc]
        og.zero_grad()
        self.manual_backward(g_loss())
        og.step()
        od.zero_grad()
        self.manual_backward(d_loss())
        od.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)]


class GAN(AccumulationMixin, LightningGAN):
    """The same moved onto the mixin as the migration page says (a window per optimizer), toggled or not."""

    def __init__(self, toggle: bool = False) -> None:
        super().__init__()
        self.toggle = toggle
        self.configure_accumulation(1, step_schedulers=False)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        for i, (opt, loss) in enumerate(zip(self.optimizers(), self.losses(batch), strict=True)):  # type: ignore[arg-type]
            if self.toggle:
                self.toggle_optimizer(opt)
            with self.accumulate(batch, optimizer=i) as acc:
                acc.backward(loss())
            if self.toggle:
                self.untoggle_optimizer(opt)


def test_a_pass_into_another_optimizers_window_is_refused_and_toggling_trains_as_lightning() -> None:
    """Before, the generator's pass went into the discriminator's window, silently (0.17 off)."""
    model = GAN()
    before = params_of(model)
    t = trainer()
    with pytest.raises(RuntimeError, match=r"reached `d\.(weight|bias)`, a parameter of another optimizer.*toggle"):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == 0 and max_diff(params_of(model), before) == 0.0
    lightning, toggled = LightningGAN(), GAN(toggle=True)
    trainer().fit(lightning, loader(DATA, 4))
    trainer().fit(toggled, loader(DATA, 4))
    assert max_diff(params_of(toggled), params_of(lightning)) <= 1e-15
    assert all(p.requires_grad for p in toggled.parameters())


def test_a_fit_leaves_no_guard_on_its_optimizers_or_parameters() -> None:
    """The guards' hooks (a step the mixin does not take is refused; a pass into another optimizer's window) go with
    the fit: after it, the optimizers and parameters hold the hooks they had before, and a step of the user's own
    (a plain loop after ``trainer.fit``) is the optimizer's."""
    model = GAN(toggle=True)
    trainer().fit(model, loader(DATA, 4))
    optimizers = [o.optimizer for o in model.optimizers()]  # type: ignore[union-attr]
    assert [len(o._optimizer_step_pre_hooks) for o in optimizers] == [0, 0]
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    before = params_of(model)
    for optimizer in optimizers:
        optimizer.zero_grad()
    g_loss, d_loss = model.losses(next(iter(loader(DATA, 4))))
    (g_loss() + d_loss()).backward()
    for optimizer in optimizers:
        optimizer.step()
    assert max_diff(params_of(model), before) > 0.0


# ---------------------------------------------------------------------- hooks refused at the start
def test_a_callbacks_hook_with_the_modules_signature_is_refused_at_the_start() -> None:
    """Before, Python's bare TypeError came after the first optimizer step."""

    class ModuleSignature(pl.Callback):
        def on_window_end(self, window: WindowReport) -> None:  # type: ignore[override]
            pass

    for model, callbacks in [(Model(), []), (Automatic(), [AccumulationScheduler(3)])]:
        model.fail = False
        before = params_of(model)
        t = trainer(callbacks=[*callbacks, ModuleSignature()])
        refused = r"`ModuleSignature.on_window_end` must take `\(trainer, pl_module, window\)`"
        with pytest.raises(TypeError, match=refused):
            t.fit(model, loader(DATA, 4))
        assert t.global_step == 0 and max_diff(params_of(model), before) == 0.0


# ---------------------------------------------------------------------- estimated_stepping_batches, several optimizers
class TwoSharing(AccumulationMixin, pl.LightningModule):
    """Two optimizers in one window, each with a OneCycle sized by the estimate (``optimizers=``)."""

    def __init__(self, optimizers: int | None) -> None:
        super().__init__()
        self.a, self.b, self.optimizers_arg = make_net(seed=0), make_net(seed=1), optimizers
        self.configure_accumulation(2, step_schedulers=True)

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward(mean_loss(self.a, batch) + mean_loss(self.b, batch))

    def configure_optimizers(self) -> Any:
        if self.optimizers_arg is None:
            self.estimate = lightning_accum.estimated_stepping_batches(self.trainer)
        else:
            self.estimate = lightning_accum.estimated_stepping_batches(self.trainer, optimizers=self.optimizers_arg)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.a, self.b)]
        cycle = torch.optim.lr_scheduler.OneCycleLR
        configs = [{"scheduler": cycle(o, 0.2, total_steps=self.estimate), "interval": "step"} for o in optimizers]
        return optimizers, configs


@pytest.mark.parametrize(("max_steps", "windows"), [(-1, 8), (5, 3), (6, 3), (100, 8)])
def test_the_estimate_with_two_optimizers_under_max_steps(max_steps: int, windows: int) -> None:
    """`max_steps` counts both optimizers' steps (global_step): 5 ends the fit after 3 windows, each scheduler
    stepped 3 times; the estimate said 5, and no warning came."""
    model = TwoSharing(optimizers=2)
    t = trainer(max_epochs=2, max_steps=max_steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is sized for")
        t.fit(model, loader(DATA, 4))
    assert model.estimate == windows
    assert [c.scheduler.last_epoch for c in t.lr_scheduler_configs] == [windows, windows]
    assert t.global_step == 2 * windows


def test_a_scheduler_sized_for_one_optimizer_of_two_is_warned_about() -> None:
    with pytest.warns(UserWarning, match=r"sized for 5 steps, but this fit takes 3 .*optimizers=2\)"):
        trainer(max_epochs=2, max_steps=5).fit(TwoSharing(optimizers=None), loader(DATA, 4))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, float("nan"), "2"])
def test_the_estimates_optimizers_argument_is_refused_with_the_fix(bad: Any) -> None:
    model = TwoSharing(optimizers=bad)
    with pytest.raises((TypeError, ValueError), match=r"optimizers=.*integer >= 1"):
        trainer(max_epochs=2, max_steps=5).fit(model, loader(DATA, 4))


def test_the_estimates_optimizers_argument_takes_any_integer() -> None:
    model = TwoSharing(optimizers=np.int64(2))  # type: ignore[arg-type]
    trainer(max_epochs=2, max_steps=5).fit(model, loader(DATA, 4))
    assert model.estimate == 3


# ---------------------------------------------------------------------- scheduler idioms and messages
class StepsInWindowEnd(AccumulationMixin, pl.LightningModule):
    """The documented idiom: the model steps its schedulers in `on_window_end` (or, ``last``, after the block)."""

    def __init__(self, case: str, idiom: str) -> None:
        super().__init__()
        self.case, self.idiom = case, idiom
        self.g, self.d = make_net(seed=0), make_net(seed=1)
        items = {"normalize": "items"} if case == "items" else {}
        self.configure_accumulation(3, step_schedulers=False, **items)  # type: ignore[arg-type]
        self.steps = [0, 0]

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        if self.case == "skip" and batch_idx == 7:
            return None
        j = batch_idx % 2 if self.case == "gan" else None
        nets = [self.g, self.d] if j is None else [[self.g, self.d][j]]
        with self.accumulate(batch, optimizer=j) as acc:
            total, tokens = token_losses(nets[0], batch)
            for net in nets[1:]:
                total = total + token_losses(net, batch)[0]
            if self.case == "items":
                acc.backward(total, items=0 if 3 <= batch_idx <= 5 else tokens)
            else:
                acc.backward(total / tokens)
        if self.idiom == "acc.last" and acc.last:
            for i in [0, 1] if j is None else [j]:
                self.lr_schedulers()[i].step()  # type: ignore[index]
        return None

    def on_window_end(self, window: WindowReport) -> None:
        for i in window.optimizers:
            self.steps[i] += 1
            if self.idiom == "on_window_end":
                self.lr_schedulers()[i].step()  # type: ignore[index]

    def configure_optimizers(self) -> Any:
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.g, self.d)]
        return optimizers, [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in optimizers]


@pytest.mark.parametrize("case", ["skip", "items", "gan"])
def test_on_window_end_steps_a_scheduler_once_per_optimizer_step(case: str) -> None:
    """What the guide recommends, where `if acc.last:` after the block does not (the guide says why): skipped
    tail batches, a window of no items, alternating windows."""
    model = StepsInWindowEnd(case, "on_window_end")
    trainer(max_epochs=2).fit(model, loader(DATA, 4))
    assert [c.scheduler.last_epoch for c in model.trainer.lr_scheduler_configs] == model.steps
    last = StepsInWindowEnd(case, "acc.last")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(max_epochs=2).fit(last, loader(DATA, 4))
    assert [c.scheduler.last_epoch for c in last.trainer.lr_scheduler_configs] != last.steps


class EpochStepper(Model):
    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]


def test_the_own_step_refusal_names_when_the_mixin_steps_an_epoch_scheduler() -> None:
    """It said "at each window's end" for an epoch scheduler too."""
    with pytest.raises(RuntimeError, match=r'of "interval": "epoch", after each epoch\)'):
        trainer(max_epochs=2).fit(EpochStepper(step_schedulers=True), loader(DATA, 4))


def test_frequency_counts_the_windows_optimizer_steps_across_epochs() -> None:
    """The documented meaning (the package's callback's): 9 batches, k = 1, `frequency=2`, 2 epochs: 9 steps of
    the scheduler (Lightning's loop, counting each epoch's batches from 0, steps 8 times)."""

    class Frequency(Model):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 2}]

    t = trainer(max_epochs=2)
    t.fit(Frequency(k=1, step_schedulers=True), loader(TokenData(36), 4))
    assert t.global_step == 18 and t.lr_scheduler_configs[0].scheduler.last_epoch == 9


@pytest.mark.parametrize("frequency", [2.0, True])
def test_a_frequency_that_is_not_an_integer_is_refused_at_the_start(frequency: Any) -> None:
    class Frequency(Model):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": frequency}]

    t = trainer()
    with pytest.raises(ValueError, match=r'"frequency" of the StepLR scheduler must be an integer >= 1'):
        t.fit(Frequency(step_schedulers=True), loader(DATA, 4))
    assert t.global_step == 0


@pytest.mark.parametrize("step_schedulers", [True, False])
def test_an_unknown_scheduler_key_is_refused_with_the_fix(step_schedulers: bool) -> None:
    """Lightning's manual optimization failed on it with a bare TypeError from `LRSchedulerConfig`."""

    class Unknown(Model):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
            return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequncy": 2}]

    with pytest.raises(ValueError, match=r"unsupported keys in the lr scheduler dict: \['frequncy'\]: remove them"):
        trainer().fit(Unknown(step_schedulers=step_schedulers), loader(DATA, 4))


class _SaveInside(pl.Callback):
    def __init__(self, path: Any) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == 1:  # (inside the window of batches 0-2)
            trainer.save_checkpoint(self.path)


def test_a_window_saved_on_two_ranks_is_refused_on_one_before_anything_is_restored(tmp_path: Any) -> None:
    """(The fast check of ``tests/distributed/test_faults_ddp.py``'s mixin case.) A checkpoint written inside a
    window on 2 ranks (here one written on 1, its window's state edited to say 2 ranks, each with its part) is
    refused as it loads into a fit on 1, naming both numbers: nothing of it is restored (the model's progress is
    a new model's, and a fit afresh counts as a new model's)."""
    from lightning_accum import Progress

    path, edited = tmp_path / "one.ckpt", tmp_path / "two.ckpt"
    make_trainer(callbacks=[_SaveInside(path)], max_epochs=1).fit(
        ManualTokenModel(schedule=3), ResumableLoader(TokenData(24), 4)
    )
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k, state in checkpoint["callbacks"].items() if isinstance(state, dict) and "grads" in state]
    state = checkpoint["callbacks"][key]
    state["world_size"], state["ranks"] = 2, [([2.0, 8.0, 8.0], state["grads"])] * 2
    torch.save(checkpoint, edited)
    model = ManualTokenModel(schedule=3)
    with pytest.raises(ValueError, match=r"two.ckpt' was saved inside an accumulation window on 2 rank\(s\).*on 1"):
        make_trainer(max_epochs=1).fit(model, ResumableLoader(TokenData(24), 4), ckpt_path=edited)
    assert model.accumulation_progress == Progress()
    make_trainer(max_epochs=1).fit(model, ResumableLoader(TokenData(24), 4))  # (used again, afresh)
    fresh = ManualTokenModel(schedule=3)
    make_trainer(max_epochs=1).fit(fresh, ResumableLoader(TokenData(24), 4))
    assert model.accumulation_progress == fresh.accumulation_progress


@pytest.mark.parametrize("decay_when", ["saved", "resumed"])
def test_a_checkpoint_resumes_with_a_gradient_decay_added_or_taken_away(tmp_path: Any, decay_when: str) -> None:
    """A checkpoint written without ``reset=GradientDecay(...)`` resumes under one (its state starts afresh), and
    one written with it resumes without: the fit goes on to the uninterrupted fit's steps and micro-batches."""
    from lightning_accum import GradientDecay

    from helpers import ManualTokenModel

    def model(decay: bool) -> ManualTokenModel:
        return ManualTokenModel(schedule=3, **({"reset": GradientDecay(0.5)} if decay else {}))

    path = tmp_path / "inside.ckpt"
    full = model(decay_when == "saved")
    make_trainer(callbacks=[_SaveInside(path)], max_epochs=2).fit(full, ResumableLoader(TokenData(24), 4))
    resumed = model(decay_when == "resumed")
    make_trainer(max_epochs=2).fit(resumed, ResumableLoader(TokenData(24), 4), ckpt_path=path)
    done = resumed.accumulation_progress
    assert (done.step, done.microbatches) == (full.accumulation_progress.step, full.accumulation_progress.microbatches)


class _ZeroesAt(ZeroesToo):
    def training_step(self, batch: Batch, batch_idx: int) -> None:
        self.started.append(batch_idx)
        super().training_step(batch, batch_idx)


def test_a_zero_grad_in_training_step_is_refused_at_the_first_batch_with_no_window_open_yet() -> None:
    """Inside a batch ``zero_grad()`` is refused even where no window holds a gradient yet (the fit's first
    batch): at that batch, not at the next."""
    model = _ZeroesAt("self.optimizers()")
    model.started = []
    with pytest.raises(RuntimeError, match=r"`zero_grad\(\)` was called during training"):
        trainer().fit(model, loader(DATA, 4))
    assert model.started == [0]


class _PassesInTheFirstEpochOnly(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 0:
            super().training_step(batch, batch_idx)
            return
        with self.accumulate(batch):
            pass  # (a block without a pass)


def test_an_epoch_without_a_backward_pass_after_one_with_passes_is_refused_at_its_end() -> None:
    """The count of blocks and passes starts afresh each epoch: a second epoch whose blocks make no backward pass is
    refused at its end, after a first that trained."""
    with pytest.raises(RuntimeError, match=r"A whole epoch of .* blocks \(6\) made no backward pass"):
        trainer(max_epochs=2).fit(_PassesInTheFirstEpochOnly(schedule=2), loader(TokenData(24), 4))


class _Named(nn.Module):
    """A module the guards name in their refusals."""


@pytest.mark.parametrize(
    ("outputs", "named"),
    [
        ({"loss": torch.tensor(1.0)}, r"returned a loss but ran no"),
        (torch.tensor(1.0), r"returned a Tensor but ran no"),
        ({"loss": torch.tensor(1.0), "log": 1}, r"returned keys \['loss', 'log'\] but ran no"),
        ({"out": 1}, r"returned keys \['out'\] but ran no"),
        (3.0, r"returned a float but ran no"),
    ],
)
def test_a_step_returning_something_without_a_block_is_refused_naming_what_it_returned(
    outputs: Any, named: str
) -> None:
    """``MixinGuards.batch_end``: a ``training_step`` that returned anything but ``None`` (or Lightning's ``{}``
    for it) and ran no block in a model whose blocks never ran is refused, saying what it returned."""
    from lightning_accum._trainer.guards import MixinGuards

    with pytest.raises(RuntimeError, match=r"^`_Named.training_step` " + named):
        MixinGuards().batch_end(_Named(), outputs, blocks_ran=False)


@pytest.mark.parametrize(
    ("outputs", "blocks_ran", "block_this_batch"),
    [
        (None, False, False),  # skipped on purpose
        ({}, False, False),  # what Lightning hands the hook for a `None`
        ({"loss": torch.tensor(1.0)}, True, False),  # the model's blocks ran before: a skipped batch
        ({"loss": torch.tensor(1.0)}, False, True),  # a block ran in this batch
    ],
)
def test_a_step_without_a_block_is_let_through_where_lightning_would_skip_it(
    outputs: Any, blocks_ran: bool, block_this_batch: bool
) -> None:
    from lightning_accum._trainer.guards import MixinGuards

    guards = MixinGuards()
    guards.batch_start()
    if block_this_batch:
        guards.block_opened((0,), list, [], dict)
    guards.batch_end(_Named(), outputs, blocks_ran=blocks_ran)  # (no refusal)
    with pytest.raises(RuntimeError, match="returned a loss"):  # the next batch, without a block, is refused
        guards.batch_end(_Named(), {"loss": torch.tensor(1.0)}, blocks_ran=False)
