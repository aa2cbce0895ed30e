"""AccumulationMixin (manual optimization) against the float64 reference loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_resume import checkpoint_at
from torch import nn

from lightning_accum import AccumulationMixin, Constant, Lambda, Piecewise, Ramp, Schedule

from helpers import (
    KRecorder,
    ManualTokenModel,
    Reference,
    ResumableLoader,
    TokenData,
    count_tokens,
    loader,
    make_net,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

TOL = 1e-12
SCHEDULES = {
    "step_mid_epoch": Piecewise({0: 3, 4: 2, 9: 4}, unit="step"),
    "samples_ramp": Ramp(1, 6, over=120, unit="samples"),
    "lambda_odd": Lambda(lambda p: 1 + (p.step * 7) % 5),
    "k_exceeds_epoch": Constant(20),
}


def fit_manual(
    data: TokenData, epochs: int = 3, batch_size: int = 4, **kwargs: Any
) -> tuple[ManualTokenModel, KRecorder]:
    trainer_kwargs = kwargs.pop("trainer_kwargs", {})
    model = ManualTokenModel(**kwargs)
    recorder = KRecorder()
    t = trainer(callbacks=[recorder], max_epochs=epochs, **trainer_kwargs)
    t.fit(model, loader(data, batch_size))
    return model, recorder


@pytest.mark.parametrize("mode", ["backward", "each", "heads"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_mean_matches_reference(name: str, mode: str) -> None:
    schedule, data = SCHEDULES[name], TokenData(50)
    model, recorder = fit_manual(data, mode=mode, schedule=schedule)
    expected, sizes = Reference(schedule).run([rank_batches(data, 4)] * 3)
    if mode == "backward":  # one backward pass per micro-batch: the recorder counts micro-batches
        assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) <= TOL
    assert model.accumulation_progress.step == len(sizes) == model.trainer.global_step
    assert model.accumulation_progress.samples == 3 * len(data)


@pytest.mark.parametrize("mode", ["backward", "items_arg", "each", "heads"])
def test_items_matches_reference(mode: str) -> None:
    schedule, data = Ramp(1, 5, over=300, unit="items"), TokenData(50)
    reduction = "mean" if mode == "items_arg" else "sum"
    count = None if mode == "items_arg" else count_tokens
    if mode == "items_arg":
        schedule = Ramp(1, 5, over=10, unit="step")  # an items schedule needs `count`
    model, _ = fit_manual(data, mode=mode, reduction=reduction, schedule=schedule, normalize="items", count=count)
    expected, _ = Reference(schedule, normalize="items").run([rank_batches(data, 4)] * 3)
    assert max_diff(params_of(model), expected) <= TOL


@pytest.mark.parametrize("lr_scaling", [None, "sqrt"])
def test_clipping_schedulers_and_lr_scaling(lr_scaling: str | None) -> None:
    schedule, data = Ramp(1, 4, over=8, unit="step"), TokenData(50)

    def scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)

    model, _ = fit_manual(
        data,
        schedule=schedule,
        gradient_clip_val=0.05,
        lr_scaling=lr_scaling,
        scheduler=scheduler,
        scheduler_frequency=2,
        step_schedulers=True,
        optimizer="adam",
        lr=0.01,
    )
    reference = Reference(
        schedule,
        clip=0.05,
        lr_scaling=lr_scaling,
        scheduler=scheduler,
        scheduler_frequency=2,
        optimizer="adam",
        lr=0.01,
    )
    expected, _ = reference.run([rank_batches(data, 4)] * 3)
    assert max_diff(params_of(model), expected) <= TOL


def test_bf16_mixed_on_cpu() -> None:
    schedule, data = Piecewise({0: 3, 4: 2}, unit="step"), TokenData(50)
    model, _ = fit_manual(data, epochs=2, schedule=schedule, trainer_kwargs={"precision": "bf16-mixed"})
    expected, _ = Reference(schedule).run([rank_batches(data, 4)] * 2)
    underweighted, _ = Reference(schedule, short_window="full").run([rank_batches(data, 4)] * 2)
    error = max_diff([p.double() for p in params_of(model)], expected)
    assert error < 2e-2
    assert error < 0.5 * max_diff(underweighted, expected)


def test_validation_inside_a_window_keeps_the_gradient() -> None:
    """Lightning zeroes gradients before validation; inside a window the mixin keeps them."""
    schedule, data = Constant(4), TokenData(48)

    class WithValidation(ManualTokenModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val", float(batch["x"].sum()))

    model = WithValidation(schedule=schedule)
    t = trainer(max_epochs=2, val_check_interval=3, limit_val_batches=1)  # validation after batches 3, 6, 9, 12
    t.fit(model, loader(data, 4), loader(data, 4))
    expected, _ = Reference(schedule).run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(model), expected) <= TOL


class TwoNets(AccumulationMixin, pl.LightningModule):
    """Two independent regressors, two optimizers: windows per optimizer, or one shared window."""

    def __init__(self, shared: bool, schedule: Schedule) -> None:
        super().__init__()
        self.a, self.b = make_net(seed=1), make_net(seed=2)
        self.shared = shared
        self.configure_accumulation(schedule)

    @staticmethod
    def loss(net: nn.Module, batch: Any) -> torch.Tensor:
        err = (net(batch["x"]) - batch["y"]).squeeze(-1) ** 2 * batch["mask"]
        return err.sum() / batch["mask"].sum()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.shared:
            with self.accumulate(batch) as acc:
                acc.backward_each([lambda: self.loss(self.a, batch), lambda: self.loss(self.b, batch)])
            return
        opt_a, _ = self.optimizers()  # type: ignore[misc]
        with self.accumulate(batch, optimizer=opt_a) as acc:
            acc.backward(self.loss(self.a, batch))
        if batch_idx % 2 == 0:  # b trains on even batches only: its windows span other batches
            with self.accumulate(batch, optimizer=1) as acc:
                acc.backward(self.loss(self.b, batch))

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.05)]


def reference_net(seed: int, schedule: Schedule, epochs: list[list[list[Any]]], lr: float) -> list[torch.Tensor]:
    return Reference(schedule, seed=seed, lr=lr, optimizer="plain-sgd").run(epochs)[0]


@pytest.mark.parametrize("shared", [False, True])
def test_two_optimizers(shared: bool) -> None:
    schedule, data = Piecewise({0: 2, 3: 3}, unit="step"), TokenData(52)  # 13 batches: last index even
    model = TwoNets(shared, schedule)
    trainer(max_epochs=2).fit(model, loader(data, 4))
    batches = rank_batches(data, 4)
    expected_a = reference_net(1, schedule, [batches] * 2, lr=0.1)
    b_batches = batches if shared else [[b for i, b in enumerate(batches[0]) if i % 2 == 0]]
    expected_b = reference_net(2, schedule, [b_batches] * 2, lr=0.05)
    assert max_diff(params_of(model.a), expected_a) <= TOL
    assert max_diff(params_of(model.b), expected_b) <= TOL


@pytest.mark.parametrize("stop", [3, 10, "epoch_end"])
def test_resume_equals_uninterrupted(tmp_path: Path, stop: int | str) -> None:
    schedule = Ramp(1, 5, over=160, unit="items")

    def run(ckpt: Path | None = None, resume: Path | None = None) -> ManualTokenModel:
        model = ManualTokenModel(
            mode="heads", reduction="sum", schedule=schedule, normalize="items", count=count_tokens
        )
        callbacks = (
            [ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")]
            if ckpt
            else []
        )
        t = trainer(callbacks=callbacks, max_epochs=3, enable_checkpointing=ckpt is not None)
        t.fit(model, ResumableLoader(TokenData(50), 4), ckpt_path=resume)
        return model

    full = run(ckpt=tmp_path)
    resumed = run(resume=checkpoint_at(tmp_path, stop))
    assert max_diff(params_of(resumed), params_of(full)) <= TOL
    assert resumed.accumulation_progress == full.accumulation_progress


# ---------------------------------------------------------------------------- errors
class Forced(ManualTokenModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True


class Leaky(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            pass
        acc.backward(self.net(batch["x"]).sum())


class NoSuper(ManualTokenModel):
    def configure_callbacks(self) -> list[pl.Callback]:
        return []


def make_bad_step(kind: str) -> type[ManualTokenModel]:
    class Bad(ManualTokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            out = self.net(batch["x"])
            with self.accumulate(batch) as acc:
                if kind == "weights":
                    acc.backward_each([lambda: out.sum()], weights=[1.0, 2.0])
                elif kind == "non_scalar":
                    acc.backward_each([lambda: out])
                elif kind == "no_grad":
                    acc.backward_each([lambda: out.detach().sum()])
                else:
                    acc.backward(out.mean())

    return Bad


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (Forced, "automatic_optimization` is True"),
        (Leaky, "outside its `with self.accumulate"),
        (NoSuper, r"super\(\).configure_callbacks\(\)"),
        (make_bad_step("weights"), "`weights` has 2 entries for 1 closures"),
        (make_bad_step("non_scalar"), "closure 0 is a tensor of shape"),
        (make_bad_step("no_grad"), "does not require grad"),
        (lambda: make_bad_step("items")(normalize="items"), "needs the micro-batch's item count"),
    ],
)
def test_run_time_errors(make: Any, match: str) -> None:
    model = make()
    before = params_of(model)
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer(max_epochs=1).fit(model, loader(TokenData(16), 4))
    assert max_diff(params_of(model), before) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(schedule=0), "int >= 1"),
        (dict(normalize="tokens"), "normalize"),
        (dict(reset="decay"), "`reset`"),
        (dict(gradient_clip_val=-1.0), "gradient_clip_val"),
        (dict(gradient_clip_algorithm="l1"), "gradient_clip_algorithm"),
        (dict(lr_scaling="cubic"), "lr_scaling"),
        (dict(schedule=Ramp(1, 4, over=10, unit="items")), "`count` is needed"),
    ],
)
def test_configuration_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ManualTokenModel(**kwargs)


@pytest.mark.parametrize("shared", [1, 5, 6, 7])
def test_windows_that_would_share_parameters_are_refused_naming_the_first_five(shared: int) -> None:
    """Two optimizers' windows sharing ``shared`` parameters: refused, naming them, the first 5 and then ``...``
    where there are more."""
    import re
    from types import SimpleNamespace

    from lightning_accum._trainer.windows import MixinWindows

    module = nn.Module()
    for i in range(8):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(1)))
    params = list(module.parameters())
    first, second = torch.optim.SGD(params[:shared], lr=0.1), torch.optim.SGD(params[:shared] + params[7:], lr=0.1)
    module.optimizers = lambda: [SimpleNamespace(optimizer=first), SimpleNamespace(optimizer=second)]  # type: ignore[method-assign,assignment]
    windows = MixinWindows(module)
    windows.engine((0,))
    names = ", ".join(f"p{i}" for i in range(min(shared, 5))) + (", ..." if shared > 5 else "")
    with pytest.raises(ValueError, match=rf"optimizers \[1\] and \[0\] would share parameters \({re.escape(names)}\)"):
        windows.check_disjoint((1,))


class _Timed(ManualTokenModel):
    def on_window_end(self, window: Any) -> None:
        self.seconds.append(window.seconds)


def test_a_second_fits_first_window_is_timed_from_that_fits_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """``WindowReport.seconds`` of a fit's first window runs from the fit's start, on a model fit before too (its
    windows' engines kept): on a host clock faked to tick 1 s a reading, and 1000 s between the fits."""
    import time

    clock = [0.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", tick)
    model = _Timed(schedule=3)
    model.seconds = []
    trainer(max_epochs=1).fit(model, ResumableLoader(TokenData(24), 4))
    clock[0] += 1000.0
    first = len(model.seconds)
    trainer(max_epochs=1).fit(model, ResumableLoader(TokenData(24), 4))
    assert first == 2 and len(model.seconds) == 4
    assert all(s is not None and 0 < s < 1000 for s in model.seconds), model.seconds
