"""What a stepped window reports, where Lightning's tools read it: ``trainer.callback_metrics``
fresh after every window (``EarlyStopping``, ``ModelCheckpoint(monitor=)``, ``ReduceLROnPlateau``
on ``accum/loss``, read at the default ``log_every_n_steps=50``, where a value logged with
``self.log`` would be 50 steps old), ``accum/lr`` the learning rate each step used, a window
resumed from inside reported as if uninterrupted, other callbacks' ``on_window_end``, and the
warning on an LR scheduler sized for the wrong number of steps. Each against the float64
reference's windows."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from test_window_metrics import DATA, SCHEDULE
from torch import nn

import lightning_accum
from lightning_accum import AccumulationMixin, AccumulationScheduler, WindowReport

from helpers import (
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenModel,
    default_dtype,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

EPOCHS = 3  # (SCHEDULE and DATA as the window metrics' tests: short last windows)


@pytest.fixture(autouse=True)
def float64_metrics() -> Iterator[None]:
    """The metrics are tensors of the default dtype, as Lightning's: float64 here, to compare at 1e-12."""
    with default_dtype(torch.float64):
        yield


def reference(**kwargs: Any) -> Reference:
    ref = Reference(SCHEDULE, **kwargs)
    ref.run([rank_batches(DATA, 4)] * EPOCHS)
    return ref


def epoch_ends() -> list[int]:
    """The index of each epoch's last window among the run's windows (the schedule is keyed on steps)."""
    ends, step, per_epoch = [], 0, math.ceil(len(DATA) / 4)
    for _ in range(EPOCHS):
        start = 0
        while start < per_epoch:
            start += min(SCHEDULE(lightning_accum.Progress(step=step)), per_epoch - start)
            step += 1
        ends.append(step - 1)
    return ends


def adapters() -> list[Any]:
    return ["callback", "mixin"]


def model_and_callbacks(adapter: str, **options: Any) -> tuple[pl.LightningModule, list[pl.Callback]]:
    if adapter == "callback":
        return TokenModel(**options), [AccumulationScheduler(SCHEDULE)]
    return ManualTokenModel(schedule=SCHEDULE, **options), []


class SeenByEarlyStopping(EarlyStopping):
    """Records what it compares at each epoch's end."""

    def __init__(self) -> None:
        super().__init__(monitor="accum/loss", patience=100, check_on_train_epoch_end=True)
        self.seen: list[float] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.append(float(trainer.callback_metrics[self.monitor]))
        super().on_train_epoch_end(trainer, pl_module)


@pytest.mark.parametrize("adapter", adapters())
def test_early_stopping_compares_each_epochs_last_window(adapter: str) -> None:
    model, callbacks = model_and_callbacks(adapter)
    stopping = SeenByEarlyStopping()
    trainer(callbacks=[*callbacks, stopping], max_epochs=EPOCHS).fit(model, loader(DATA, 4))
    ref = reference()
    expected = [ref.losses[i] for i in epoch_ends()]
    assert max(abs(a - b) for a, b in zip(stopping.seen, expected, strict=True)) <= 1e-12
    assert stopping.best_score.item() == min(stopping.seen)


@pytest.mark.parametrize("adapter", adapters())
def test_early_stopping_stops_on_the_window_loss(adapter: str) -> None:
    """Stopped at the first epoch whose last window's loss is under the threshold: not before, as a
    stale first-step value compared three times would."""
    ref = reference()
    ends = [ref.losses[i] for i in epoch_ends()]
    threshold = (ends[1] + ends[2]) / 2 if ends[2] < ends[1] else None
    assert threshold is not None and ends[0] > threshold and ends[1] > threshold
    model, callbacks = model_and_callbacks(adapter)
    stopping = EarlyStopping(monitor="accum/loss", stopping_threshold=threshold, check_on_train_epoch_end=True)
    t = trainer(callbacks=[*callbacks, stopping], max_epochs=EPOCHS + 2)
    t.fit(model, loader(DATA, 4))
    assert t.current_epoch == EPOCHS  # (stopped after epoch index EPOCHS - 1)


@pytest.mark.parametrize("adapter", adapters())
def test_model_checkpoint_keeps_the_best_window(tmp_path: Path, adapter: str) -> None:
    model, callbacks = model_and_callbacks(adapter)
    best = ModelCheckpoint(tmp_path, monitor="accum/loss", mode="min", every_n_train_steps=1, save_top_k=1)
    t = trainer(callbacks=[*callbacks, best], max_epochs=EPOCHS, enable_checkpointing=True)
    t.fit(model, loader(DATA, 4))
    ref = reference()
    assert abs(best.best_model_score.item() - min(ref.losses)) <= 1e-12
    assert f"step={ref.losses.index(min(ref.losses)) + 1}" in best.best_model_path


class RecordingPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, patience=0, factor=0.5)
        self.fed: list[float] = []

    def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
        self.fed.append(float(metrics))
        super().step(metrics)


class PlateauModel(TokenModel):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.plateau = RecordingPlateau(opt)
        config = {"scheduler": self.plateau, "interval": "step", "monitor": "accum/loss"}
        return {"optimizer": opt, "lr_scheduler": config}


class ManualPlateauModel(ManualTokenModel):
    configure_optimizers = PlateauModel.configure_optimizers


@pytest.mark.parametrize("adapter", adapters())
def test_reduce_lr_on_plateau_is_fed_each_window_loss(adapter: str) -> None:
    model = PlateauModel() if adapter == "callback" else ManualPlateauModel(schedule=SCHEDULE, step_schedulers=True)
    callbacks = [AccumulationScheduler(SCHEDULE)] if adapter == "callback" else []
    trainer(callbacks=callbacks, max_epochs=EPOCHS).fit(model, loader(DATA, 4))
    ref = Reference(SCHEDULE, optimizer="plain-sgd", scheduler=RecordingPlateau)
    expected, _ = ref.run([rank_batches(DATA, 4)] * EPOCHS)
    assert len(model.plateau.fed) == len(ref.losses)
    assert max(abs(a - b) for a, b in zip(model.plateau.fed, ref.losses, strict=True)) <= 1e-12
    assert max_diff(list(model.net.parameters()), expected) <= 1e-12


class Windows(pl.Callback):
    """Every ``on_window_end``: the reports, and an exponential moving average of the parameters
    updated at window ends only (a user's EMA callback)."""

    def __init__(self, decay: float = 0.7) -> None:
        self.reports: list[WindowReport] = []
        self.decay = decay
        self.average: list[torch.Tensor] | None = None

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: WindowReport) -> None:
        self.reports.append(window)
        params = [p.detach().clone() for p in pl_module.parameters()]
        self.average = params if self.average is None else [
            self.decay * a + (1 - self.decay) * p for a, p in zip(self.average, params, strict=True)
        ]  # fmt: skip


@pytest.mark.parametrize("adapter", adapters())
def test_on_window_end_once_per_step_with_the_windows_numbers(adapter: str) -> None:
    model, callbacks = model_and_callbacks(adapter, lr=0.1)
    seen = Windows()
    trainer(callbacks=[*callbacks, seen], max_epochs=EPOCHS).fit(model, loader(DATA, 4))
    average: list[list[torch.Tensor]] = []

    def ema(net: nn.Module) -> None:
        params = [p.detach().clone() for p in net.parameters()]
        average.append(params if not average else [0.7 * a + 0.3 * p for a, p in zip(average[-1], params, strict=True)])

    ref = Reference(SCHEDULE, after_step=ema)
    _, sizes = ref.run([rank_batches(DATA, 4)] * EPOCHS)
    assert [r.step for r in seen.reports] == list(range(1, len(sizes) + 1))
    assert [r.microbatches for r in seen.reports] == sizes
    batch_sizes = iter([len(b["x"]) for _ in range(EPOCHS) for b in rank_batches(DATA, 4)[0]])
    assert [r.samples for r in seen.reports] == [sum(next(batch_sizes) for _ in range(m)) for m in sizes]
    assert max(abs(r.loss - loss) for r, loss in zip(seen.reports, ref.losses, strict=True)) <= 1e-12  # type: ignore[operator]
    norms = [float(r.grad_norm) for r in seen.reports]  # type: ignore[arg-type]
    assert max(abs(a - b) for a, b in zip(norms, ref.grad_norms, strict=True)) <= 1e-12
    assert {r.k for r in seen.reports} == {3, 2} and all(r.lr == {"lr": 0.1} for r in seen.reports)
    assert seen.reports[-1].progress.step == len(sizes) and seen.reports[-1].epoch == EPOCHS - 1
    assert max_diff(seen.average, average[-1]) <= 1e-12  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        seen.reports[0].k = 5  # type: ignore[misc]


@pytest.mark.parametrize("adapter", adapters())
def test_accum_lr_is_the_rate_each_step_used(adapter: str) -> None:
    """``lr_scaling`` and ``lr_schedule`` change the LR for the step only: ``LearningRateMonitor``
    (reading the optimizer at a batch's start) shows the base rate, ``accum/lr`` the one stepped with."""
    options = {"lr_scaling": "linear", "lr_schedule": lambda progress: 1 / (1 + progress.step)}
    if adapter == "callback":
        model: pl.LightningModule = TokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(SCHEDULE, **options)]
    else:
        model, callbacks = ManualTokenModel(schedule=SCHEDULE, **options), []
    seen = Windows()
    logged: list[float] = []

    class Logged(pl.Callback):
        def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: WindowReport) -> None:
            logged.append(float(trainer.callback_metrics["accum/lr"]))

    trainer(callbacks=[*callbacks, seen, Logged()], max_epochs=1).fit(model, loader(DATA, 4))
    expected = [0.1 * r.k / 3 / r.step for r in seen.reports]
    assert max(abs(r.lr["lr"] - e) for r, e in zip(seen.reports, expected, strict=True)) <= 1e-15
    assert max(abs(a - e) for a, e in zip(logged, expected, strict=True)) <= 1e-15


class TwoOptimizers(AccumulationMixin, pl.LightningModule):
    """Two Adams (the second with two parameter groups) stepped in one window."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()
        self.configure_accumulation(2)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward((self.a(batch["x"]) + self.b(batch["x"])).square().mean())

    def configure_optimizers(self) -> Any:
        first = torch.optim.Adam(self.a.parameters(), lr=0.01)
        second = torch.optim.Adam([{"params": [self.b.weight]}, {"params": [self.b.bias], "lr": 0.02}], lr=0.03)
        return [first, second]


def test_accum_lr_names_are_learning_rate_monitors(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    seen = Windows()
    monitor = LearningRateMonitor()
    t = trainer(callbacks=[seen, monitor], max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(TwoOptimizers(), loader(DATA, 4))
    assert set(seen.reports[-1].lr) == {"lr-Adam", "lr-Adam-1/pg1", "lr-Adam-1/pg2"} == set(monitor.lrs)
    assert dict(seen.reports[-1].lr) == {"lr-Adam": 0.01, "lr-Adam-1/pg1": 0.03, "lr-Adam-1/pg2": 0.02}
    assert {f"accum/{name}" for name in monitor.lrs} <= set(t.logged_metrics)


class SaveInside(pl.Callback):
    """Saves a checkpoint after the batch ``at`` (inside a window)."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at, self.batches = path, at, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches += 1
        if self.batches == self.at:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("adapter", adapters())
def test_a_window_resumed_from_inside_reports_as_uninterrupted(tmp_path: Path, adapter: str) -> None:
    def fit(callbacks: list[pl.Callback], ckpt: Path | None = None) -> list[WindowReport]:
        model, own = model_and_callbacks(adapter)
        seen = Windows()
        t = trainer(callbacks=[*own, *callbacks, seen], max_epochs=2)
        t.fit(model, ResumableLoader(DATA, 4), ckpt_path=ckpt)
        return seen.reports

    path = tmp_path / "inside.ckpt"
    full = fit([SaveInside(path, at=16)])  # after the first micro-batch of epoch 1's second window
    resumed = fit([], ckpt=path)
    assert resumed[0].step == full[-len(resumed)].step == 7 and resumed[0].microbatches == 2
    for a, b in zip(resumed, full[-len(resumed) :], strict=True):
        assert (a.step, a.k, a.microbatches, a.samples) == (b.step, b.k, b.microbatches, b.samples)
        assert abs(a.loss - b.loss) <= 1e-12 and abs(float(a.grad_norm) - float(b.grad_norm)) <= 1e-12  # type: ignore[operator,arg-type]


class OneCycle(TokenModel):
    def __init__(self, total: str) -> None:
        super().__init__()
        self.total = total

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = (
            self.trainer.estimated_stepping_batches
            if self.total == "lightning"
            else lightning_accum.estimated_stepping_batches(self.trainer)
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=int(steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_scheduler_sized_with_lightnings_estimate_is_warned_about() -> None:
    run = trainer(callbacks=[AccumulationScheduler(SCHEDULE)], max_epochs=EPOCHS)
    warned = r"OneCycleLR is sized for 39 steps, but this fit takes 19 .*estimated_stepping_batches\(trainer\)"
    with pytest.warns(UserWarning, match=warned):
        run.fit(OneCycle("lightning"), loader(DATA, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|isinstance.treespec)")
        trainer(callbacks=[AccumulationScheduler(SCHEDULE)], max_epochs=EPOCHS).fit(OneCycle("ours"), loader(DATA, 4))


# ---------------------------------------------------------------------- where each window is reported
class Alternating(AccumulationMixin, pl.LightningModule):
    """A GAN's habit: two optimizers over their own layers, each with a window of its own, one after the
    other in every batch (`toggle_optimizer` keeps each pass out of the other's parameters); k = 1 at first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()
        self.configure_accumulation(lightning_accum.Piecewise({0: 1, 2: 2}, unit="step"))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for i, optimizer in enumerate(self.optimizers()):  # type: ignore[arg-type]
            self.toggle_optimizer(optimizer)
            with self.accumulate(batch, optimizer=i) as acc:
                acc.backward((self.a(batch["x"]) * self.b(batch["x"]) - batch["y"]).square().mean())
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]


class Fresh(pl.Callback):
    """At each window's end: what `callback_metrics` holds under the window's own names."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[int, ...], float, float]] = []

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: WindowReport) -> None:
        name = "accum/" if len(window.optimizers) == len(trainer.optimizers) else f"accum/opt{window.optimizers[0]}/"
        self.seen.append((window.optimizers, float(trainer.callback_metrics[name + "loss"]), window.loss))  # type: ignore[arg-type]


def test_a_windows_names_are_fixed_by_its_group() -> None:
    """Before: optimizer 0's first window (k = 1, before optimizer 1's existed) went to `accum/*`, the others to
    `accum/opt0/*`, so `accum/loss` stayed at step 1 and `EarlyStopping(monitor="accum/loss")` stopped early."""
    fresh = Fresh()
    t = trainer(callbacks=[fresh], max_epochs=3)
    t.fit(Alternating(), loader(DATA, 4))
    assert {group for group, _, _ in fresh.seen} == {(0,), (1,)}
    assert all(metric == loss for _, metric, loss in fresh.seen)  # every window fresh under its own name
    accum = {name for name in t.callback_metrics if name.startswith("accum/")}
    assert accum and all(name.startswith(("accum/opt0/", "accum/opt1/")) for name in accum)
    with pytest.raises(RuntimeError, match="Early stopping conditioned on metric `accum/loss` which is not available"):
        trainer(callbacks=[EarlyStopping("accum/loss", check_on_train_epoch_end=True)]).fit(
            Alternating(), loader(DATA, 4)
        )


class HookedModel(ManualTokenModel):
    def __init__(self, order: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.order = order

    def on_window_end(self, window: WindowReport) -> None:
        self.order.append(f"module {window.step}")


class HookedAutomatic(TokenModel):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    on_window_end = HookedModel.on_window_end


class Heard(pl.Callback):
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def on_window_end(self, trainer: pl.Trainer, pl_module: Any, window: WindowReport) -> None:
        self.order.append(f"callback {window.step}")


@pytest.mark.parametrize("adapter", adapters())
def test_on_window_end_on_the_module_after_the_callbacks(adapter: str) -> None:
    """Lightning calls its hooks on the LightningModule as well as on callbacks, the module's after; the module's
    hooks take no trainer: `on_window_end(self, window)`. Before: never called on the module."""
    order: list[str] = []
    if adapter == "callback":
        model: pl.LightningModule = HookedAutomatic(order)
        callbacks: list[pl.Callback] = [AccumulationScheduler(SCHEDULE)]
    else:
        model, callbacks = HookedModel(order, schedule=SCHEDULE), []
    trainer(callbacks=[*callbacks, Heard(order)], max_epochs=1).fit(model, loader(DATA, 4))
    steps = len(order) // 2
    assert steps == 5 and order == [f"{who} {step}" for step in range(1, steps + 1) for who in ("callback", "module")]


class CallbackSignature(ManualTokenModel):
    def on_window_end(self, trainer: Any, pl_module: Any, window: WindowReport) -> None:
        pass


def test_a_module_hook_with_the_callbacks_signature_is_refused_at_the_start() -> None:
    model = CallbackSignature(schedule=2)
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(max_epochs=1)
    with pytest.raises(TypeError, match=r"`CallbackSignature.on_window_end` must take the window's report alone"):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == 0 and max_diff(list(model.parameters()), before) == 0.0


@pytest.mark.parametrize("adapter", adapters())
def test_logged_metrics_hold_tensors_as_lightnings_own(tmp_path: Path, adapter: str) -> None:
    """Lightning keeps what it logs in `trainer.logged_metrics` as tensors; the package put floats there."""
    from lightning.pytorch.loggers import CSVLogger

    model, callbacks = model_and_callbacks(adapter)
    seen = Windows()
    t = trainer(callbacks=[*callbacks, seen], max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(model, loader(DATA, 4))
    accum = {name: value for name, value in t.logged_metrics.items() if name.startswith("accum/")}
    assert {"accum/k", "accum/loss", "accum/grad_norm", "accum/lr"} <= set(accum)
    assert all(isinstance(value, torch.Tensor) and value.dim() == 0 for value in accum.values())
    assert float(accum["accum/loss"]) == seen.reports[-1].loss
    assert accum["accum/loss"] is t.callback_metrics["accum/loss"]  # (one tensor for both readers)


def _named_scheduler(m: Any) -> Any:
    opt = torch.optim.SGD([{"params": m.a.parameters()}, {"params": m.b.parameters(), "lr": 0.01}], lr=0.1)
    return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step", "name": "mysched"}]


def _named_group(m: Any) -> Any:
    return [torch.optim.SGD([{"params": m.a.parameters(), "name": "body"}], lr=0.1),
            torch.optim.SGD(m.b.parameters(), lr=0.01)]  # fmt: skip


def _second_scheduled(m: Any) -> Any:
    first, second = torch.optim.SGD(m.a.parameters(), lr=0.1), torch.optim.SGD(m.b.parameters(), lr=0.01)
    return [first, second], [{"scheduler": torch.optim.lr_scheduler.StepLR(second, 1, 0.5), "interval": "step"}]


def _named_and_unnamed(m: Any) -> Any:
    first, second = torch.optim.SGD(m.a.parameters(), lr=0.1), torch.optim.SGD(m.b.parameters(), lr=0.01)
    step = torch.optim.lr_scheduler.StepLR
    return [first, second], [{"scheduler": step(first, 1, 0.5), "interval": "step"},
                             {"scheduler": step(second, 1, 0.5), "interval": "step", "name": "second"}]  # fmt: skip


class Configured(AccumulationMixin, pl.LightningModule):
    def __init__(self, configure: Any) -> None:
        super().__init__()
        self.a, self.b, self.configure = nn.Linear(3, 1).double(), nn.Linear(3, 1).double(), configure
        self.configure_accumulation(2, step_schedulers=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward((self.a(batch["x"]) + self.b(batch["x"])).square().mean())

    def configure_optimizers(self) -> Any:
        return self.configure(self)


@pytest.mark.parametrize("configure", [_named_scheduler, _named_group, _second_scheduled, _named_and_unnamed])
def test_accum_lr_names_follow_learning_rate_monitor_with_names_and_orders(tmp_path: Path, configure: Any) -> None:
    """A scheduler config's `name` (`mysched/pg1`, not `lr-SGD/pg1`), a single group's `name`, and the monitor's
    order (the optimizers with schedulers named first) give the keys `LearningRateMonitor` gives."""
    from lightning.pytorch.loggers import CSVLogger

    seen, monitor = Windows(), LearningRateMonitor()
    t = trainer(callbacks=[seen, monitor], max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(Configured(configure), loader(DATA, 4))
    assert set(seen.reports[-1].lr) == set(monitor.lrs)
    assert {f"accum/{name}" for name in monitor.lrs} <= set(t.logged_metrics)


class _BatchEndReader(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        pass


class _EpochEndOnly(pl.Callback):
    def on_train_epoch_end(self, *args: Any) -> None:
        pass


def test_which_callbacks_listed_before_may_read_the_windows_metrics_at_a_batch_end() -> None:
    """``readers_before``: a callback listed before the scheduler with an ``on_train_batch_end`` of its own (a
    class's, or one set on the instance as ``LambdaCallback`` does), not Lightning's or this package's own, nor one
    without that hook; none listed after it."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import LambdaCallback, TQDMProgressBar

    from lightning_accum._trainer.reporting import readers_before

    own = AccumulationScheduler(2)
    before = [
        pl.Callback(), ModelCheckpoint(), TQDMProgressBar(), _EpochEndOnly(), LambdaCallback(on_train_epoch_end=print),
        _BatchEndReader(), LambdaCallback(on_train_batch_end=print),
    ]  # fmt: skip
    found = readers_before(SimpleNamespace(callbacks=[*before, own, _BatchEndReader()]), own)
    assert found == ["_BatchEndReader", "LambdaCallback"]
