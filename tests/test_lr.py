"""The learning rate follows the window: the true number of optimizer steps of a fit, and LR
multipliers keyed on progress (composed with the Trainer's LR scheduler and with lr_scaling)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import lightning_accum as la
from lightning_accum import AccumulationScheduler, NoiseScale, Piecewise, Progress, Ramp, Schedule
from lightning_accum.lr import LRSchedule, WarmupCosine, WarmupLinear

from helpers import KRecorder, ManualTokenModel, TokenData, TokenModel, count_tokens, loader, token_losses, trainer

DATA = TokenData(50)  # 13 batches of 4 per epoch, the last one of 2


# ---------------------------------------------------------------------- the shapes
def test_shapes_against_their_formulas() -> None:
    cos = WarmupCosine(warmup=10, total=50, unit="samples", final=0.2, start=0.1)
    lin = WarmupLinear(warmup=10, total=50, unit="items", final=0.0)
    for x in range(0, 70, 3):
        warm = 0.1 + 0.9 * x / 10
        t = min(1.0, max(0.0, (x - 10) / 40))
        expected_cos = warm if x < 10 else 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * t))
        expected_lin = x / 10 if x < 10 else 1 - t
        assert cos(Progress(samples=x)) == pytest.approx(expected_cos, abs=1e-15)
        assert lin(Progress(items=x)) == pytest.approx(expected_lin, abs=1e-15)
    assert eval(repr(cos), {"WarmupCosine": WarmupCosine}).__dict__ == cos.__dict__


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: WarmupCosine(10, 10), "`total`=10 must be greater than `warmup`=10"),
        (lambda: WarmupCosine(-1, 10), "`warmup` must be a number >= 0"),
        (lambda: WarmupLinear(1, 10, final=2.0), r"`final` must be a multiplier in \[0, 1\]"),
        (lambda: WarmupLinear(1, 10, unit="tokenz"), "`unit` must be one of"),
        (lambda: AccumulationScheduler(2, lr_schedule=0.5), "`lr_schedule` must be a function of Progress"),
        (lambda: ManualTokenModel(schedule=2, lr_schedule="cosine"), "`lr_schedule` must be a function of Progress"),
    ],
)
def test_bad_arguments(make: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


# ---------------------------------------------------------------------- the number of steps
class Sized(TokenModel):
    """Sizes a OneCycleLR with the package's count of optimizer steps, as a user would."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optimizer="plain-sgd", **kwargs)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = la.estimated_stepping_batches(self.trainer)
        self.lightning_total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class ManualSized(ManualTokenModel):
    def configure_optimizers(self) -> Any:
        return Sized.configure_optimizers(self)  # type: ignore[arg-type]


SCHEDULES = {
    # k = 3 from 51 samples on: the first epoch ends at 50 (its last batch holds 2), not 52
    "samples-ramp": Ramp(1, 5, over=102, unit="samples"),
    "step-piecewise": Piecewise({0: 3, 4: 2, 9: 4}, unit="step"),  # mid-epoch changes, short windows
    "epoch-piecewise": Piecewise({0: 2, 1: 3, 2: 5}, unit="epoch"),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("limits", [{}, {"limit_train_batches": 11}, {"max_steps": 9}])
def test_onecycle_sized_with_it_ends_at_the_last_step(name: str, limits: dict[str, Any]) -> None:
    model = Sized()
    t = trainer(callbacks=[AccumulationScheduler(SCHEDULES[name])], max_epochs=3, **limits)
    t.fit(model, loader(DATA, 4))
    assert model.total == t.global_step
    scheduler = t.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == model.total  # OneCycle ran its whole course, to its last step
    if "max_steps" not in limits:
        assert model.lightning_total > model.total  # what Lightning's own estimate would have stretched it to


class Unsized(IterableDataset[Any]):
    """A loader's data without a length: DATA's 13 batches of 4 (the last of 2), once."""

    def __iter__(self) -> Any:
        return iter([DATA.batch(slice(i, i + 4)) for i in range(0, len(DATA), 4)])


class Counted(TokenModel):
    def configure_optimizers(self) -> Any:
        self.total = la.estimated_stepping_batches(self.trainer)
        return super().configure_optimizers()


def test_a_loader_without_a_length_counts_max_steps_or_is_refused() -> None:
    model = Counted()
    trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1, max_steps=4).fit(model, DataLoader(Unsized(), None))
    assert model.total == 4  # (max_steps bounds it: ceil(13 / 3) = 5 windows would reach it)
    with pytest.raises(ValueError, match="The training loader has no length"):
        trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1).fit(Counted(), DataLoader(Unsized(), None))


def test_mixin_counts_its_steps_too() -> None:
    model = ManualSized(schedule=SCHEDULES["step-piecewise"], step_schedulers=True)
    t = trainer(max_epochs=2)
    t.fit(model, loader(DATA, 4))
    assert model.total == model.accumulation_progress.step == t.lr_scheduler_configs[0].scheduler.last_epoch


def test_without_the_package_it_is_lightnings_estimate() -> None:
    model = Sized()
    trainer(max_epochs=2, accumulate_grad_batches=3).fit(model, loader(DATA, 4))
    assert model.total == model.lightning_total == 2 * 5


@pytest.mark.parametrize(
    "schedule", [Ramp(1, 4, over=100, unit="items"), NoiseScale(2, 4)], ids=["items", "noise"]
)  # fmt: skip
def test_items_and_noise_cannot_be_known_in_advance(schedule: Schedule) -> None:
    callback = AccumulationScheduler(schedule, count=count_tokens)
    with pytest.raises(ValueError, match=r"cannot be known in advance.*lr_schedule=.*unit='items'"):
        trainer(callbacks=[callback], max_epochs=1).fit(Sized(), loader(DATA, 4))


# ---------------------------------------------------------------------- lr_schedule
class LRRecorder(pl.Callback):
    """The learning rate the optimizer steps with (after the package scaled it), and after the step."""

    def __init__(self) -> None:
        self.stepped: list[float] = []
        self.after: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.stepped.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append(trainer.optimizers[0].param_groups[0]["lr"])


def step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def test_lr_schedule_per_step_by_hand() -> None:
    """A ramp over samples that changes k mid-epoch; a cosine keyed on samples; the Trainer's StepLR and
    lr_scaling='sqrt' on top: each step's LR is their product, keyed on the progress its window opened with."""
    schedule = Ramp(1, 4, over=40, unit="samples")
    shape = WarmupCosine(warmup=12, total=120, unit="samples", final=0.1)
    recorder, windows = LRRecorder(), KRecorder()
    callback = AccumulationScheduler(schedule, lr_schedule=shape, lr_scaling="sqrt")
    t = trainer(callbacks=[callback, recorder, windows], max_epochs=2)
    t.fit(TokenModel(lr=0.1, scheduler=step_lr), loader(DATA, 4))
    expected, samples, first_k, batch = [], 0, None, 0
    for step, m in enumerate(windows.windows):  # windows as Lightning ran them; their samples from the data
        k = schedule(Progress(step=step, samples=samples))
        first_k = first_k or k
        expected.append(0.1 * 0.5 ** (step // 3) * shape(Progress(samples=samples)) * math.sqrt(k / first_k))
        sizes = [min(4, 50 - 4 * (i % 13)) for i in range(batch, batch + m)]
        samples, batch = samples + sum(sizes), batch + m
    assert len(set(windows.windows)) > 2  # k changed along the way
    assert recorder.stepped == pytest.approx(expected, rel=1e-12, abs=0)
    assert all(after in {0.1 * 0.5**i for i in range(20)} for after in recorder.after)  # restored after each step


def test_lr_schedule_same_in_the_mixin() -> None:
    schedule, shape = Piecewise({0: 2, 3: 3}, unit="step"), WarmupLinear(warmup=8, total=60, unit="samples")
    callback_lrs, mixin_lrs = LRRecorder(), LRRecorder()
    t = trainer(callbacks=[AccumulationScheduler(schedule, lr_schedule=shape), callback_lrs], max_epochs=2)
    t.fit(TokenModel(), loader(DATA, 4))
    t = trainer(callbacks=[mixin_lrs], max_epochs=2)
    t.fit(ManualTokenModel(schedule=schedule, lr_schedule=shape), loader(DATA, 4))
    assert mixin_lrs.stepped == callback_lrs.stepped and len(mixin_lrs.stepped) > 5


class Countdown(LRSchedule):
    """A stateful multiplier: halves at every call (its state must survive a checkpoint)."""

    def __init__(self) -> None:
        self.calls = 0

    def multiplier(self, progress: Progress) -> float:
        self.calls += 1
        return 0.5**self.calls

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state_dict: Any) -> None:
        self.calls = int(state_dict["calls"])


def test_stateful_lr_schedule_is_checkpointed() -> None:
    callback = AccumulationScheduler(2, lr_schedule=Countdown())
    trainer(callbacks=[callback], max_epochs=1).fit(TokenModel(), loader(DATA, 4))
    state = callback.state_dict()
    assert state["lr_schedule"] == {"calls": 7}
    twin = AccumulationScheduler(2, lr_schedule=Countdown())
    twin.load_state_dict(state)
    assert twin.lr_schedule.calls == 7  # type: ignore[union-attr]


@pytest.mark.parametrize("lr_schedule", [None, lambda progress: 1.0], ids=["none", "a function"])
def test_a_checkpoints_lr_schedule_state_without_a_stateful_lr_schedule_is_warned_about(lr_schedule: Any) -> None:
    state = AccumulationScheduler(2, lr_schedule=Countdown()).state_dict()
    other = AccumulationScheduler(2, lr_schedule=lr_schedule)
    with pytest.warns(UserWarning, match=r"holds the state of an `lr_schedule`.* goes on without it"):
        other.load_state_dict(state)
    assert other.progress == Progress()


def test_bad_multiplier_is_named() -> None:
    with pytest.raises(ValueError, match=r"`lr_schedule` .* returned -1.0 .*multiplier >= 0"):
        AccumulationScheduler(2, lr_schedule=lambda progress: -1.0)  # (found at construction)
    with pytest.raises(ValueError, match=r"`lr_schedule` .* returned 5000.0 .*above 1000 is surely a mistake"):
        AccumulationScheduler(2, lr_schedule=lambda progress: 5000.0)
    callback = AccumulationScheduler(2, lr_schedule=lambda progress: -1.0 if progress.step else 1.0)
    with pytest.raises(ValueError, match=r"`lr_schedule` .* returned -1.0 .*multiplier >= 0"):
        trainer(callbacks=[callback], max_epochs=1).fit(TokenModel(), loader(DATA, 4))


# ---------------------------------------------------------------------- AdaScale
def test_adascale_gain_closed_form_through_the_engine() -> None:
    """Known |G|^2 and tr(Sigma) fed to the engine's estimator: each step's gain, LR factor and
    Progress.scaled_steps equal the closed form."""
    from lightning_accum._core.engine import WindowEngine
    from lightning_accum._core.probe import NoiseProbe

    engine = WindowEngine(Piecewise({0: 2, 1: 4, 2: 8}, unit="step"), lr_scaling="adascale")
    assert isinstance(engine.probe, NoiseProbe)
    grad_sq, trace, b = 0.5, 6.0, 3  # micro-batches of 3 samples
    engine.adascale.beta = 0.0
    expected_scaled = 0.0
    for step in range(3):
        window = engine.open(0, 0)
        for _ in range(window.k):
            engine.count(b, b)
        closing = engine.close(None)
        big = b * window.k
        base = 2 * b
        r = 1.0 if step == 0 else (trace / base + grad_sq) / (trace / big + grad_sq)
        assert closing.gain == closing.lr_factor == pytest.approx(r, rel=1e-15)
        expected_scaled += r
        engine.advance(0)
        assert engine.progress.scaled_steps == pytest.approx(expected_scaled, rel=1e-15)
        engine.adascale.update(grad_sq + trace / b, b, grad_sq + trace / big, big)  # this window's measurement


def test_adascale_base_batch_is_the_first_stepped_window_not_an_empty_first_one() -> None:
    """With ``normalize="items"`` a first window of no items is not stepped; AdaScale's base batch ``B_0`` is the
    first stepped window's (found by the differential fuzzer: an empty first window made ``B_0 = 0`` and the
    gain 1 for the rest of the fit, silently, the LRs up to 3x off)."""
    from lightning_accum._core.engine import WindowEngine

    engine = WindowEngine(la.Constant(2), normalize="items", lr_scaling="adascale")
    engine.adascale.beta = 0.0
    grad_sq, trace = 0.5, 6.0
    gains = []
    for items in (0, 4, 6):  # per micro-batch: the first window holds none, the next 8, then 12
        engine.open(0, 0)
        for _ in range(2):
            engine.count(3, items)
        closing = engine.close(None)
        gains.append(closing.gain)
        engine.advance(0)
        if items:  # (a measurement, two-batch: one micro-batch and the window)
            engine.adascale.update(grad_sq + trace / items, items, grad_sq + trace / (2 * items), 2 * items)
    assert gains[:2] == [1.0, 1.0]  # (no measurement before them)
    assert gains[2] == pytest.approx((trace / 8 + grad_sq) / (trace / 12 + grad_sq), rel=1e-15)


@pytest.mark.parametrize(
    ("beta", "windows", "batch", "first_batch", "gain"),
    [
        # one window of |G|^2 = tr(Sigma) = 4: (4/2 + 4) / (4/8 + 4) = 6 / 4.5
        (0.0, [(4.0, 4.0, 1.0)], 8, 2, 4 / 3),
        # (|G|^2, tr, weight) (2, 6, 1) then (6, 2, 0.5) at beta = 0.5: sums 0.5 * 1 + 0.5 = 1, 0.5 * 2 + 0.5 * 6 = 4,
        # 0.5 * 6 + 0.5 * 2 = 4, so |G|^2 = tr = 4 though neither window's are equal
        (0.5, [(2.0, 6.0, 1.0), (6.0, 2.0, 0.5)], 8, 2, 4 / 3),
        (0.5, [(2.0, 6.0, 1.0), (6.0, 2.0, 0.5)], 2, 8, (4 / 8 + 4) / (4 / 2 + 4)),  # (a smaller batch: under 1)
        (0.0, [(0.0, 4.0, 1.0)], 8, 2, 4.0),  # (no signal: the linear rule, B / B0)
        (0.0, [(4.0, 0.0, 1.0)], 8, 2, 1.0),  # (no noise: 1 from the formula)
        (0.0, [(0.0, 0.0, 1.0)], 8, 2, 1.0),  # (|G|^2 = tr = 0: 0 / 0 is taken as 1)
        (0.0, [], 8, 2, 1.0),  # (nothing measured)
    ],
)
def test_adascale_gain_is_the_formula_wherever_the_estimates_are_not_both_zero(
    beta: float, windows: list[tuple[float, float, float]], batch: int, first_batch: int, gain: float
) -> None:
    """``adascale_gain`` from an estimator fed known window estimates (``add``: moving averages weighted by
    ``weight``, decayed by ``beta`` per window): ``(tr / B0 + |G|^2) / (tr / B + |G|^2)``, also where the averaged
    trace equals the averaged squared norm; 1 only where both are 0 or nothing was measured."""
    from lightning_accum.lr import adascale_gain
    from lightning_accum.noise import NoiseScaleEstimator

    estimator = NoiseScaleEstimator(beta=beta)
    for grad_sq, trace, weight in windows:
        estimator.add(grad_sq, trace, weight)
    assert adascale_gain(estimator, batch, first_batch) == pytest.approx(gain, rel=1e-15)


def test_adascale_on_a_regression_with_known_noise() -> None:
    """x ~ N(0, I_10), y = x . w* + N(0, 1), the model at |w - w*| = 1 with learning rate 0: |G|^2 = 1,
    tr(Sigma) = 21. Windows of 2, then 4, then 8 micro-batches of 4 samples: the gain of the last
    steps against the closed form (1 at B = B0 = 8; (21/8 + 1) / (21/32 + 1) = 2.19 at B = 32)."""
    from test_noise import TRUE_GRAD_SQ, TRUE_TRACE, Regressor, regression
    from torch.utils.data import DataLoader, TensorDataset

    x, y, w = regression(12_000)
    schedule = Piecewise({0: 2, 100: 4, 200: 8}, unit="step")
    callback, recorder = AccumulationScheduler(schedule, lr_scaling="adascale"), Gains()
    trainer(callbacks=[callback, recorder], max_epochs=1).fit(
        Regressor(w), DataLoader(TensorDataset(x, y), batch_size=4)
    )
    closed = (TRUE_TRACE / 8 + TRUE_GRAD_SQ) / (TRUE_TRACE / 32 + TRUE_GRAD_SQ)
    measured = sum(recorder.gains[-100:]) / 100
    assert recorder.gains[:100] == [1.0] * 100  # B = B0
    assert measured == pytest.approx(closed, rel=0.1), (measured, closed)
    print(f"AdaScale gain at B = 32: measured {measured:.4f}, closed form {closed:.4f}")
    assert recorder.lrs[-1] == 0.0  # (the regression's learning rate is 0: the truth stays put)


class Gains(pl.Callback):
    def __init__(self) -> None:
        self.gains: list[float] = []
        self.lrs: list[float] = []
        self._scaled = 0.0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaled = next(c for c in trainer.callbacks if isinstance(c, AccumulationScheduler)).progress.scaled_steps
        if scaled != self._scaled:
            self.gains.append(scaled - self._scaled)
            self._scaled = scaled


def test_adascale_same_in_the_mixin_and_keyed_schedules() -> None:
    schedule = Piecewise({0: 2, 4: 3}, unit="step")
    shape = WarmupLinear(warmup=2, total=40, unit="scaled_steps")
    callback = AccumulationScheduler(schedule, lr_scaling="adascale", lr_schedule=shape)
    callback_lrs, mixin_lrs = LRRecorder(), LRRecorder()
    trainer(callbacks=[callback, callback_lrs], max_epochs=2).fit(TokenModel(), loader(DATA, 4))
    model = ManualTokenModel(schedule=schedule, lr_scaling="adascale", lr_schedule=shape)
    trainer(callbacks=[mixin_lrs], max_epochs=2).fit(model, loader(DATA, 4))
    assert mixin_lrs.stepped == pytest.approx(callback_lrs.stepped, rel=1e-12)
    assert model.accumulation_progress.scaled_steps == pytest.approx(callback.progress.scaled_steps, rel=1e-12)
    assert callback.progress.scaled_steps != callback.progress.step  # gains other than 1 were taken
    keyed = Piecewise({0: 2, 2: 3}, unit="scaled_steps")
    assert [keyed(Progress(scaled_steps=v)) for v in (1.7, 2.3)] == [2, 3]


def test_adascale_is_refused_where_the_noise_cannot_be_measured() -> None:
    from lightning_accum import Constant
    from lightning_accum._core import sync
    from lightning_accum._core.probe import check_noise_under

    with pytest.raises(RuntimeError, match="`lr_scaling='adascale'` cannot measure the gradient noise under FSDP2"):
        check_noise_under(sync.SyncPlan("fsdp2", skip=True), Constant(2), "adascale")
    schedule = Piecewise({0: 2}, unit="scaled_steps")
    with pytest.raises(ValueError, match="cannot be known in advance"):
        trainer(callbacks=[AccumulationScheduler(schedule)], max_epochs=1).fit(Sized(), loader(DATA, 4))


# ---------------------------------------------------------------------- the mixin's `step_schedulers=True`
class NoStep:
    """A scheduler without `.step` (stateful, as Lightning requires)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _plateau(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt)


BAD_CONFIGS = {  # what Lightning's automatic loop refuses before training (or fails on at its first step)
    "plateau without monitor": (lambda opt: _plateau(opt), "must include a monitor when a `ReduceLROnPlateau`"),
    "plateau dict without monitor": (lambda opt: {"scheduler": _plateau(opt)}, "must include a monitor"),
    "reduce_on_plateau without monitor": (
        lambda opt: {"scheduler": step_lr(opt), "reduce_on_plateau": True}, "must include a monitor"),
    "no step": (lambda opt: NoStep(opt), "`NoStep` doesn't follow PyTorch's LRScheduler API.*lr_scheduler_step` hook"),
    "frequency 0": (lambda opt: {"scheduler": step_lr(opt), "frequency": 0}, r'"frequency" .* integer >= 1 .* is 0'),
    "frequency -2": (lambda opt: {"scheduler": step_lr(opt), "frequency": -2}, "integer >= 1 .* is -2"),
    "frequency 1.5": (lambda opt: {"scheduler": step_lr(opt), "frequency": 1.5}, "integer >= 1 .* is 1.5"),
    "frequency True": (lambda opt: {"scheduler": step_lr(opt), "frequency": True}, "integer >= 1 .* is True"),
    "interval steps": (
        lambda opt: {"scheduler": step_lr(opt), "interval": "steps"}, 'must be "step" or "epoch" but is "steps"'),
}  # fmt: skip


class Configured(ManualTokenModel):
    def __init__(self, make: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make = make

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [self.make(optimizer)]


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_what_lightnings_automatic_loop_refuses_is_refused_at_the_fits_start(name: str) -> None:
    """Before: refused after the first epoch had trained (global_step 4; a raw AttributeError, a
    ZeroDivisionError), or never stepped, silently (`interval="steps"`)."""
    make, match = BAD_CONFIGS[name]
    model = Configured(make, schedule=2, step_schedulers=True)
    before = [p.detach().clone() for p in model.parameters()]
    t = trainer(max_epochs=2)
    with pytest.raises((ValueError, TypeError), match=rf"(?=.*{match})(?=.*step_schedulers=True)"):
        t.fit(model, loader(DATA, 4))
    assert t.global_step == 0 and all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("name", ["plateau without monitor", "no step", "frequency 0", "interval steps"])
def test_leaving_them_to_the_model_accepts_what_lightnings_manual_optimization_does(name: str) -> None:
    model = Configured(BAD_CONFIGS[name][0], schedule=2, step_schedulers=False)
    t = trainer(max_epochs=1)
    t.fit(model, loader(DATA, 4))
    assert t.global_step == 7


class CustomStep(Configured):
    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.stepped = getattr(self, "stepped", 0) + 1


def test_a_custom_scheduler_with_its_own_lr_scheduler_step() -> None:
    model = CustomStep(lambda opt: {"scheduler": NoStep(opt), "interval": "step"}, schedule=2, step_schedulers=True)
    trainer(max_epochs=1).fit(model, loader(DATA, 4))
    assert model.stepped == 7  # once per window


def test_onecycle_per_epoch_is_warned_about_as_lightning_does() -> None:
    def onecycle(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    with pytest.warns(UserWarning, match="A `OneCycleLR` scheduler is using 'interval': 'epoch'"):
        trainer(max_epochs=1).fit(Configured(onecycle, schedule=2, step_schedulers=True), loader(DATA, 4))


@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0])
def test_step_schedulers_takes_true_false_or_none(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`step_schedulers` must be True .*, False .* or None; got"):
        ManualTokenModel(step_schedulers=bad)


class RecordingPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, factor=0.5, patience=0, threshold=0.0)
        self.fed: list[float] = []

    def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
        self.fed.append(float(metrics))
        super().step(metrics)


class EpochMean:
    """Logs the epoch's mean training loss in the LightningModule's `on_train_epoch_end` (the usual place), which
    a `ReduceLROnPlateau` of the epoch watches."""

    losses: list[torch.Tensor]
    means: list[float]

    def on_train_epoch_end(self) -> None:
        mean = torch.stack(self.losses).mean()
        self.losses.clear()
        self.means.append(float(mean))
        self.log("epoch_loss", mean)  # type: ignore[attr-defined]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)  # type: ignore[attr-defined]
        self.plateau = RecordingPlateau(optimizer)
        return [optimizer], [{"scheduler": self.plateau, "monitor": "epoch_loss"}]


class AutomaticEpochMean(EpochMean, TokenModel):
    def __init__(self) -> None:
        super().__init__()
        self.losses, self.means = [], []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = TokenModel.training_step(self, batch, batch_idx)
        self.losses.append(loss.detach())
        return loss


class ManualEpochMean(EpochMean, ManualTokenModel):
    def __init__(self) -> None:
        super().__init__(step_schedulers=True)
        self.losses, self.means = [], []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        total, tokens = token_losses(self.net, batch)
        with self.accumulate(batch) as acc:
            acc.backward(total / tokens)
        self.losses.append((total / tokens).detach())


def test_plateau_of_the_epoch_sees_what_the_module_logged_at_its_end() -> None:
    """Lightning steps an epoch's plateau after the LightningModule's `on_train_epoch_end`; the mixin stepped it
    in its own, before: one epoch stale with `strict=False`, refused at epoch 0 with `strict=True`."""
    automatic, manual = AutomaticEpochMean(), ManualEpochMean()
    trainer(max_epochs=4).fit(automatic, loader(DATA, 4))
    trainer(max_epochs=4).fit(manual, loader(DATA, 4))
    assert manual.plateau.fed == manual.means == automatic.plateau.fed == automatic.means
    assert manual.plateau.optimizer.param_groups[0]["lr"] == automatic.plateau.optimizer.param_groups[0]["lr"] == 0.25
    assert all(torch.equal(a, b) for a, b in zip(manual.parameters(), automatic.parameters(), strict=True))


class ConfiguredInSetup(ManualEpochMean):
    """`configure_accumulation` in `setup` (after the mixin's own `setup` hook) rather than `__init__`."""

    def __init__(self) -> None:
        super().__init__()
        self.configure_accumulation(step_schedulers=False)

    def setup(self, stage: str) -> None:
        self.configure_accumulation(step_schedulers=True)


def test_the_contract_configured_in_setup_still_keeps_the_plateaus_monitor() -> None:
    model = ConfiguredInSetup()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keys will be ignored.*")  # (the mixin honours them)
        trainer(max_epochs=2).fit(model, loader(DATA, 4))
    assert model.plateau.fed == model.means


@pytest.mark.parametrize("warmup", [0, 0.5])
def test_a_warmup_of_zero_or_under_one_unit_is_taken(warmup: float) -> None:
    """No warm-up (0) and a fraction of a unit are valid (the check is ``>= 0``): from 1 at ``warmup`` down the
    half cosine, by hand."""
    lr = WarmupCosine(warmup, 10.5, unit="samples")
    for x in (0.0, warmup, 3.0, 10.5):
        expected = x / warmup if x < warmup else 0.5 * (1 + math.cos(math.pi * (x - warmup) / (10.5 - warmup)))
        assert lr(Progress(samples=x)) == pytest.approx(expected, abs=1e-15)


class _PlateauMissingItsMetricFirst(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.log("flat", 1.0)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.missing, self.watching = (torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer) for _ in range(2))
        configs = [
            {"scheduler": self.missing, "monitor": "never_logged", "strict": False},
            {"scheduler": self.watching, "monitor": "flat"},
        ]
        return [optimizer], configs


def test_a_plateau_skipped_for_its_missing_metric_leaves_the_schedulers_after_it_stepped() -> None:
    """``step_schedulers=True``: a non-strict ``ReduceLROnPlateau`` whose metric is never logged is skipped with a
    warning at each epoch's end; the plateau listed after it, whose metric is logged, still steps once an epoch."""
    model = _PlateauMissingItsMetricFirst(schedule=2, step_schedulers=True)
    with pytest.warns(RuntimeWarning, match="never_logged.*the step is skipped"):
        trainer(max_epochs=2).fit(model, loader(TokenData(16), 4))
    assert (model.missing.last_epoch, model.watching.last_epoch) == (0, 2)
