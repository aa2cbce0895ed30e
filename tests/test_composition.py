"""Features with each other and with the Lightning tools beside them, where the fuzzer
(``tests/differential``) cannot reach: refusals that must come before anything is trained,
messages, resumes across schedules, and the mixin with ``ReduceLROnPlateau`` per step."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_accum as la
from lightning_accum import AccumulationScheduler, Constant, GradientDecay, NoiseScale

from helpers import ManualTokenModel, ResumableLoader, TokenData, TokenModel, count_tokens, loader, params_of, trainer
from helpers import token_losses as losses

DATA = TokenData(24)  # 6 batches of 4


class TwoOptimizers(ManualTokenModel):
    """Two optimizers, each with its own window (`optimizer=`); ``shared``: both hold the last layer."""

    def __init__(self, shared: bool) -> None:
        super().__init__(schedule=2)
        self.shared = shared

    def configure_optimizers(self) -> Any:
        first, last = list(self.net[0].parameters()), list(self.net[2].parameters())
        return [torch.optim.SGD(first + (last if self.shared else []), lr=0.1), torch.optim.SGD(last, lr=0.1)]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for i, optimizer in enumerate(self.optimizers()):
            if not self.shared:
                self.toggle_optimizer(optimizer)  # (each pass reaches its own optimizer's parameters only)
            with self.accumulate(batch, optimizer=i) as acc:
                acc.backward(losses(self.net, batch)[0] * 0.1)
            if not self.shared:
                self.untoggle_optimizer(optimizer)


def test_per_optimizer_windows_over_shared_parameters_are_refused() -> None:
    """Each window's step would take the other's gradient too (0.0475 off a float64 reference): refused before
    any step, by the first pass that reaches the other optimizer's parameters, or where the second window opens."""
    model = TwoOptimizers(shared=True)
    before = params_of(model)
    shared = r"optimizers \[1\] and \[0\] would share parameters \(net.2.weight, net.2.bias\)"
    leak = r"reached `net.2.\w+`, a parameter of another optimizer"
    with pytest.raises((ValueError, RuntimeError), match=f"{shared}|{leak}"):
        trainer(max_epochs=1).fit(model, loader(DATA, 4))
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), before, strict=True))
    trainer(max_epochs=1).fit(TwoOptimizers(shared=False), loader(DATA, 4))  # disjoint: fine


class AutoSizedMixture(ManualTokenModel):
    def __init__(self, first: str) -> None:
        super().__init__(schedule=2, reduction="sum", normalize="items", count=count_tokens)
        self.first = first

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            def plain() -> None:
                acc.backward(losses(self.net, batch)[0])

            def auto() -> None:
                acc.backward_microbatches(lambda part: losses(self.net, part)[0], size="auto")

            first, second = (plain, auto) if self.first == "plain" else (auto, plain)
            first() if batch_idx % 2 == 0 else second()


@pytest.mark.parametrize("first", ["plain", "auto"])
def test_auto_sized_passes_do_not_mix_with_others_in_a_window(first: str) -> None:
    """On out-of-memory, `size="auto"` redoes the window from its start, and only its own passes (6.9e-3 off)."""
    with pytest.raises(ValueError, match=r'`acc.backward_microbatches\(loss_fn, size="auto"\)` cannot share a window'):
        trainer(max_epochs=1).fit(AutoSizedMixture(first), loader(DATA, 4))


class ReturnsItsLoss(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        total, tokens = losses(self.net, batch)
        return total / tokens  # the automatic-optimization habit


def test_mixin_training_step_without_a_block_fails_at_the_first_batch() -> None:
    t = trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match=r"returned a loss but ran no `with self.accumulate\(batch\) as acc:`"):
        t.fit(ReturnsItsLoss(schedule=2), loader(DATA, 4))
    assert t.fit_loop.epoch_loop.batch_progress.current.ready == 1


class PlateauPerStep(ManualTokenModel):
    """`ReduceLROnPlateau` on the window loss, stepped at every optimizer step."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "seen"}}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("seen", float(batch_idx % 3))  # 0, 1, 2, 0, 1, 2: no better than the best after the first
        super().training_step(batch, batch_idx)


def test_mixin_steps_reduce_on_plateau_per_step_with_its_monitor() -> None:
    """Lightning drops `monitor` in manual optimization (`step() missing 'metrics'` before)."""
    model = PlateauPerStep(schedule=2, step_schedulers=True)
    t = trainer(max_epochs=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keys will be ignored.*")  # (the mixin honours them)
        t.fit(model, loader(DATA, 4))
    # windows end after batches 1, 3, 5, where `seen` is 1, 0, 2: 1 sets the best, 0 improves, 2 does not
    assert t.optimizers[0].param_groups[0]["lr"] == 0.5


def test_plateau_without_its_metric_says_which() -> None:
    class Unlogged(PlateauPerStep):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            ManualTokenModel.training_step(self, batch, batch_idx)

    with pytest.raises(RuntimeError, match=r"`ReduceLROnPlateau` monitors 'seen', which is not in `trainer.callback_metrics`"):
        trainer(max_epochs=1).fit(Unlogged(schedule=2, step_schedulers=True), loader(DATA, 4))


def test_noise_scale_resumed_from_another_schedule_starts_afresh(tmp_path: Path) -> None:
    """Before: a bare `KeyError: 'estimator'`."""
    saver = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)
    trainer(callbacks=[AccumulationScheduler(Constant(2)), saver], max_epochs=1, enable_checkpointing=True).fit(
        TokenModel(), ResumableLoader(DATA, 4)
    )
    callback = AccumulationScheduler(NoiseScale(2, 4, every=1, warmup=1))
    with pytest.warns(UserWarning, match=r"holds no `NoiseScale` state .* starts afresh, from k = 2"):
        trainer(callbacks=[callback], max_epochs=2).fit(TokenModel(), ResumableLoader(DATA, 4),
                                                        ckpt_path=tmp_path / "step=2.ckpt")  # fmt: skip
    assert callback.progress.step > 2


class BadNames(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward_each([lambda: losses(self.net, batch)[0]], names=["a", "b"])


def test_a_configuration_error_brings_no_recovery_warning() -> None:
    """Before: "... leaves its 0 micro-batch(es) out ... does not continue exactly" after the real error."""
    with warnings.catch_warnings(record=True) as seen, pytest.raises(ValueError, match="`names` has 2 entries"):
        warnings.simplefilter("always")
        trainer(max_epochs=1).fit(BadNames(schedule=2), loader(DATA, 4))
    assert not [w for w in seen if "accumulation window" in str(w.message)]


# ---------------------------------------------------------------------- the number of steps
class Counted(TokenModel):
    def configure_optimizers(self) -> Any:
        self.total = la.estimated_stepping_batches(self.trainer)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Endless(torch.utils.data.IterableDataset[Any]):
    def __iter__(self) -> Any:
        while True:
            yield DATA[0]


@pytest.mark.parametrize(
    ("limits", "data", "expected"),
    [
        ({"limit_train_batches": 10, "max_epochs": 2}, "iterable", 8),  # windows of 3 over 10 batches: 4 an epoch
        ({"max_steps": 0}, "sized", 0),
        ({"limit_train_batches": 0}, "sized", 0),  # (a fit that trains nothing; before: "no length" with the callback
        # and -1, Lightning's, without)
        ({"max_epochs": -1}, "sized", float("inf")),
    ],
)
def test_steps_in_the_corners(limits: dict[str, Any], data: str, expected: float) -> None:
    source = loader(DATA, 4) if data == "sized" else torch.utils.data.DataLoader(Endless(), batch_size=4)
    model = Counted()
    t = trainer(callbacks=[AccumulationScheduler(3)], **{"max_epochs": 1, **limits})
    if expected == float("inf"):  # (an endless fit: stop it at once)
        t.callbacks.append(Stop())
    t.fit(model, source)
    assert model.total == expected
    if data == "iterable":
        assert t.global_step == expected
    if expected == float("inf"):
        plain = Counted()
        trainer(callbacks=[Stop()], max_epochs=-1).fit(plain, loader(DATA, 4))
        assert plain.total == float("inf")  # without the package: Lightning's estimate, not OverflowError
    if expected == 0:
        plain = Counted()
        trainer(**{"max_epochs": 1, **limits}).fit(plain, loader(DATA, 4))
        assert plain.total == 0


def test_steps_before_a_fit_or_of_an_endless_loader_say_what_to_do() -> None:
    with pytest.raises(RuntimeError, match=r"called before a fit.*Call it inside the fit, in `configure_optimizers`"):
        la.estimated_stepping_batches(trainer(callbacks=[AccumulationScheduler(3)]))
    with pytest.raises(RuntimeError, match="called before a fit"):
        la.estimated_stepping_batches(trainer())  # (Lightning's own property gives -1 here)
    endless = torch.utils.data.DataLoader(Endless(), batch_size=4)
    with pytest.raises(ValueError, match=r"no length \(an iterable dataset\).*give the Trainer `max_steps`"):
        trainer(callbacks=[AccumulationScheduler(3)], max_epochs=1).fit(Counted(), endless)


class Stop(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.should_stop = True


class OneCycle(TokenModel):
    """The documented recipe: a OneCycle sized with the package's count, in `configure_optimizers`."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = la.estimated_stepping_batches(self.trainer)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class Halted(RuntimeError):
    pass


class Halt(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        if trainer.current_epoch == 1 and i == 5:
            raise Halted


@pytest.mark.parametrize("accumulation", ["callback", "decay alone", "none"])
def test_onecycle_recipe_resumed_mid_epoch_is_exact(tmp_path: Path, accumulation: str) -> None:
    """Before: the count set the loader up before the checkpoint restored it, so the resumed epoch started over
    (0.068 off); and so did Lightning's own estimate, which the count falls back on without an accumulation
    schedule (`GradientDecay` alone: 3.6e-2 off)."""

    def fit(callbacks: list[Any], resume: Path | None = None) -> list[torch.Tensor]:
        model = OneCycle()
        own = {"callback": [AccumulationScheduler(3)], "decay alone": [GradientDecay(0.5)], "none": []}[accumulation]
        saving = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        t = trainer(callbacks=[*own, *callbacks], max_epochs=3, enable_checkpointing=saving)
        t.fit(model, ResumableLoader(TokenData(50), 4), ckpt_path=resume)
        return params_of(model)

    saver = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(Halted):
        fit([saver, Halt()])
    # windows of 3 over 13 batches: step 6 is inside epoch 1; of 1: step 16
    resumed = fit([], resume=tmp_path / ("step=6.ckpt" if accumulation == "callback" else "step=16.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(resumed, fit([]), strict=True))


