"""What a user gets wrong, and what other Lightning components do to the loop: each refused early
with a message that names the argument and the fix, or handled so that the maths stays right."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn

from lightning_accum import (
    AccumulationMixin,
    AccumulationScheduler,
    Budget,
    GradientDecay,
    Piecewise,
    Progress,
    Ramp,
    SchedulerHorizonWarning,
)

from helpers import (
    ManualTokenModel,
    ResumableLoader,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    params_of,
    token_losses,
    trainer,
)

DATA = TokenData(24)  # 6 batches of 4


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize("bad", [math.nan, math.inf, True, 0, -1.0])
def test_clip_value_must_be_a_finite_positive_number(bad: Any) -> None:
    with pytest.raises(ValueError, match="`gradient_clip_val` must be a finite number > 0"):
        ManualTokenModel(schedule=2, gradient_clip_val=bad)


def test_ema_decay_with_factor_one_is_refused() -> None:
    for kwargs in ({"bias_correction": True}, {}):
        with pytest.raises(ValueError, match="`factor=1` with `mode='ema'`"):
            GradientDecay(1.0, mode="ema", **kwargs)
    with pytest.raises(ValueError, match=r"`factor\(0\)` returned 1 with `mode='ema'`"):
        GradientDecay(lambda step: 1.0, mode="ema").factor_at(0)
    GradientDecay(1.0, mode="sum")  # plain accumulation across steps: fine


def test_ramp_arguments_say_what_they_are() -> None:
    with pytest.raises(ValueError, match="`over` must be an int >= 1 \\(the ramp's length in `unit`, 'samples'\\)"):
        Ramp(1, 8, over=0)
    # documented: a start that is not a multiple is kept until the ramp reaches the next multiple
    ramp = Ramp(3, 8, over=8, unit="step", multiple_of=4)
    assert [ramp(Progress(step=s)) for s in range(9)] == [3, 3, 4, 4, 4, 4, 4, 4, 8]
    down = Ramp(8, 2, over=6, unit="step")  # documented: start > end ramps down
    assert [down(Progress(step=s)) for s in range(7)] == [8, 7, 6, 5, 4, 3, 2]


def per_sample_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["mask"].sum(1)  # a vector: one count per sample


def test_count_returning_a_vector_names_count_and_the_fix() -> None:
    callback = AccumulationScheduler(2, normalize="items", reduction="sum", count=per_sample_tokens)
    match = r"`count\(batch\)` returned a tensor of shape \(4,\).*rather than `.sum\(1\)`"
    with pytest.raises(ValueError, match=match):
        trainer(callbacks=[callback], max_epochs=1).fit(TokenModel(reduction="sum"), loader(DATA, 4))
    model = ManualTokenModel(schedule=2, normalize="items", count=per_sample_tokens, reduction="sum")
    with pytest.raises(ValueError, match=r"`count\(batch\)` returned a tensor of shape \(4,\)"):
        trainer(max_epochs=1).fit(model, loader(DATA, 4))


class CountsSteps(TokenModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_count_returning_a_vector_is_refused_before_the_batch_runs(reduction: str) -> None:
    """Without pieces too, a per-sample vector is refused as the batch starts, by its shape (no host read): before
    its `training_step` and any gradient. (Before issue 53, under `reduction="mean"` it reached the loss's weighting
    and raised torch's own "shape '[]' is invalid for input of size 4".)"""
    model = CountsSteps(reduction=reduction)
    before = params_of(model)
    callback = AccumulationScheduler(2, normalize="items", reduction=reduction, count=per_sample_tokens)  # type: ignore[arg-type]
    match = r"`count\(batch\)` returned a tensor of shape \(4,\).*rather than `.sum\(1\)`"
    with pytest.raises(ValueError, match=match):
        trainer(callbacks=[callback], max_epochs=1).fit(model, loader(DATA, 4))
    assert model.steps == 0 and all(p.grad is None for p in model.parameters())
    assert max(float((a - b).abs().max()) for a, b in zip(params_of(model), before, strict=True)) == 0.0


def test_negative_items_blame_acc_backward() -> None:
    class Negative(ManualTokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            with self.accumulate(batch) as acc:
                total, _ = token_losses(self.net, batch)
                acc.backward(total, items=-3)

    with pytest.raises(ValueError, match=r"`acc.backward\(loss, items=...\)` got -3"):
        trainer(max_epochs=1).fit(Negative(schedule=2, normalize="items"), loader(DATA, 4))


# ---------------------------------------------------------------------- the batch
class PopsMask(TokenModel):
    """The Hugging Face idiom: `labels = batch.pop("labels")` inside `training_step`."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        mask = batch.pop("mask")
        err = (self.net(batch["x"]) - batch["y"]).squeeze(-1) ** 2
        return (err * mask).sum()


class ManualPopsMask(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        mask = batch.pop("mask")
        with self.accumulate(batch) as acc:
            err = (self.net(batch["x"]) - batch["y"]).squeeze(-1) ** 2
            acc.backward((err * mask).sum())


def test_count_is_taken_before_training_step_changes_the_batch() -> None:
    def tokens_of(model: pl.LightningModule, callbacks: list[Any]) -> int:
        trainer(callbacks=callbacks, max_epochs=1).fit(model, loader(DATA, 4))
        return int((callbacks[0] if callbacks else model).accumulation_progress.items  # type: ignore[union-attr]
                   if not callbacks else callbacks[0].progress.items)  # fmt: skip

    expected = int(DATA.mask.sum())
    callback = AccumulationScheduler(2, normalize="items", reduction="sum", count=count_tokens)
    assert tokens_of(PopsMask(reduction="sum"), [callback]) == expected
    model = ManualPopsMask(schedule=2, normalize="items", count=count_tokens, reduction="sum")
    assert tokens_of(model, []) == expected


class Batch:
    """A batch class of the user's own: Lightning cannot find a batch size in it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


def collate(items: list[dict[str, torch.Tensor]]) -> Batch:
    return Batch(torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items]))


class OwnBatchModel(TokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return ((self.net(batch.x) - batch.y) ** 2).mean()


def test_own_batch_class_trains_unless_samples_are_needed() -> None:
    data = torch.utils.data.DataLoader(DATA, batch_size=4, collate_fn=collate)
    callback = AccumulationScheduler(2)
    t = trainer(callbacks=[callback], max_epochs=1)
    t.fit(OwnBatchModel(), data)
    assert t.global_step == 3 and callback.progress.samples == 0  # trained; samples unknown, and unused
    needs = AccumulationScheduler(Ramp(1, 4, over=100, unit="samples"))
    with pytest.raises(ValueError, match=r"The schedule Ramp.*needs each micro-batch's number of samples.*`Batch`"):
        trainer(callbacks=[needs], max_epochs=1).fit(OwnBatchModel(), data)


# ---------------------------------------------------------------------- the mixin, misused
class StepsItself(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.optimizers().step()  # type: ignore[union-attr]


class ManualBackwardInBlock(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch):
            total, tokens = token_losses(self.net, batch)
            self.manual_backward(total / tokens)


class NoBackward(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch):
            token_losses(self.net, batch)[0].backward()  # plain autograd: nothing enters a window


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (StepsItself, r"`optimizer.step\(\)` was called inside `training_step`"),
        (ManualBackwardInBlock, r"call `acc.backward\(loss\)`"),
        (NoBackward, r"A whole epoch of .* made no backward pass"),
    ],
)
def test_mixin_misuse_is_refused(model: type, match: str) -> None:
    m = model(schedule=3)
    before = params_of(m)
    with pytest.raises(RuntimeError, match=match):
        trainer(max_epochs=1).fit(m, loader(DATA, 4))
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), before, strict=True))


def test_mixin_without_configure_warns() -> None:
    class Unconfigured(AccumulationMixin, TokenModel):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> None:
            with self.accumulate(batch) as acc:
                acc.backward(super().training_step(batch, batch_idx))

    with pytest.warns(UserWarning, match=r"never called `self.configure_accumulation\(...\)`.*k = 1"):
        trainer(max_epochs=1).fit(Unconfigured(), loader(DATA, 4))


def test_the_mixin_after_the_lightning_module_is_refused_where_the_class_is_made() -> None:
    """``nn.Module.__init__`` does not call on: after the LightningModule, the mixin's ``__init__`` and hooks never
    ran (an ``AttributeError: ... '_accumulation'`` from inside the mixin at the first call)."""
    with pytest.raises(
        TypeError,
        match=r"`class M\(LightningModule, AccumulationMixin\)` puts `AccumulationMixin` after "
        r"`LightningModule`.*Put `AccumulationMixin` first: `class M\(AccumulationMixin, LightningModule\)`",
    ):

        class M(pl.LightningModule, AccumulationMixin):  # type: ignore[misc]
            pass

    class Mine(AccumulationMixin):  # a mixin of the user's own, with no module: nothing to check yet
        pass

    with pytest.raises(TypeError, match=r"`class N\(TokenModel, Mine\)`.*first: `class N\(Mine, TokenModel\)`"):

        class N(TokenModel, Mine):  # type: ignore[misc]
            pass

    class Right(Mine, TokenModel):  # type: ignore[misc]
        pass

    class Below(Right):  # a subclass of a right order keeps it
        pass

    assert Below().automatic_optimization is False


def test_callback_on_a_mixin_model_says_so() -> None:
    with pytest.raises(RuntimeError, match="uses `AccumulationMixin`, which accumulates by itself"):
        trainer(callbacks=[AccumulationScheduler(2)], max_epochs=1).fit(ManualTokenModel(schedule=2), loader(DATA, 4))


def test_refusal_leaves_the_trainer_as_the_user_set_it() -> None:
    t = trainer(callbacks=[AccumulationScheduler(2)], accumulate_grad_batches=2, max_epochs=1)
    with pytest.raises(ValueError, match="remove `accumulate_grad_batches`"):
        t.fit(TokenModel(), loader(DATA, 4))
    assert t.accumulate_grad_batches == 2


def test_no_namespace_the_user_did_not_import() -> None:
    code = (
        "import sys, torch, lightning.pytorch as pl\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "import lightning_accum as la\n"
        "class M(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(2, 1)\n"
        "    def training_step(self, b, i): return self.l(b[0]).sum()\n"
        "    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)\n"
        "t = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,\n"
        "               enable_model_summary=False, callbacks=[la.AccumulationScheduler(2)])\n"
        "t.fit(M(), data)\n"
        "print('pytorch_lightning' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


# ---------------------------------------------------------------------- windows nothing went into
class BatchNormModel(TokenModel):
    def __init__(self) -> None:
        super().__init__(optimizer="plain-sgd")
        self.net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(8, 1)).double()


class BatchNormEpoch(pl.Callback):
    """The parameters when StochasticWeightAveraging's BatchNorm epoch starts (after it put the average in)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0 and trainer.fit_loop._skip_backward:
            self.start = params_of(pl_module)


@pytest.mark.parametrize("decay", [False, True])
def test_swa_batchnorm_epoch_does_not_step(decay: bool) -> None:
    """StochasticWeightAveraging's last epoch updates BatchNorm statistics without backward; it sets
    `accumulate_grad_batches` itself, which the callback leaves alone, and Lightning then steps once
    with the last window's gradient (0.17 here without the package): the callback makes that step move
    nothing, and not count."""

    def run(callbacks: list[Any], **kwargs: Any) -> tuple[pl.Trainer, BatchNormEpoch, pl.LightningModule]:
        swa, seen, model = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1), BatchNormEpoch(), BatchNormModel()  # noqa: E501
        t = trainer(callbacks=[*callbacks, swa, seen], max_epochs=3, **kwargs)
        t.fit(model, loader(DATA, 4))
        return t, seen, model

    lightning, seen, model = run([], accumulate_grad_batches=2)
    assert not all(torch.equal(a, b) for a, b in zip(params_of(model), seen.start, strict=True))  # the stale step
    mine = [AccumulationScheduler(2)] + ([GradientDecay(0.5)] if decay else [])
    t, seen, model = run(mine)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), seen.start, strict=True))
    assert t.global_step == lightning.global_step - 1 == 3 * 3  # 3 epochs of 3 windows


PADDING = TokenData(24)
PADDING.mask[4:8] = 0.0  # the second batch of 4 holds no token: with k = 1, its window holds no item


def adam_steps(optimizer: torch.optim.Optimizer) -> int:
    return int(max(float(s["step"]) for s in optimizer.state.values()))


def test_a_window_without_items_does_not_step() -> None:
    callback = AccumulationScheduler(1, normalize="items", reduction="sum", count=count_tokens)
    t = trainer(callbacks=[callback], max_epochs=1)
    with pytest.warns(UserWarning, match="its global item count is 0"):
        t.fit(TokenModel(reduction="sum", optimizer="adam"), loader(PADDING, 4))
    assert adam_steps(t.optimizers[0]) == 5 and callback.progress.step == 5  # 6 windows, 1 without items
    assert callback.progress.samples == 24
    model = ManualTokenModel(schedule=1, normalize="items", count=count_tokens, reduction="sum", optimizer="adam")
    t = trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="its global item count is 0"):
        t.fit(model, loader(PADDING, 4))
    assert adam_steps(t.optimizers[0]) == 5 and model.accumulation_progress.step == 5


def test_windows_without_items_are_warned_about_once() -> None:
    """Every window of no items is left unstepped, and said so once per fit, not once per such window: here 2 of
    the 6 windows of each of 2 epochs hold no token."""
    data = TokenData(24)
    data.mask[4:8] = 0.0
    data.mask[16:20] = 0.0
    callback = AccumulationScheduler(1, normalize="items", reduction="sum", count=count_tokens)
    t = trainer(callbacks=[callback], max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(TokenModel(reduction="sum", optimizer="adam"), loader(data, 4))
    empty = [str(w.message) for w in caught if "An accumulation window was not stepped" in str(w.message)]
    assert len(empty) == 1 and "its global item count is 0" in empty[0] and "only warned once" in empty[0]
    assert adam_steps(t.optimizers[0]) == callback.progress.step == 2 * 4


# ---------------------------------------------------------------------- retrying with the same objects
class NonFiniteGuard(pl.Callback):
    """A user's guard: raises once, at the step of one window, after the package's rescale."""

    def __init__(self) -> None:
        self.fired = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.fired and trainer.fit_loop.epoch_loop.batch_idx == 5:
            self.fired = True
            raise FloatingPointError("non-finite gradient")


def test_retry_with_the_same_callback_objects(tmp_path: Path) -> None:
    schedule = Piecewise({0: 3, 2: 2}, unit="step")

    def run(callbacks: list[pl.Callback], resume: Path | None = None) -> list[torch.Tensor]:
        model = TokenModel(optimizer="plain-sgd")
        if resume is None:  # (only the failing run saves: a resumed one would write over its checkpoints)
            callbacks = [*callbacks, ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1, save_top_k=-1)]
        t = trainer(callbacks=callbacks, max_epochs=2, enable_checkpointing=resume is None)
        t.fit(model, ResumableLoader(TokenData(50), 4), ckpt_path=resume)
        return params_of(model)

    mine = [AccumulationScheduler(schedule), GradientDecay(0.5)]
    with pytest.raises(FloatingPointError):
        run([*mine, NonFiniteGuard()])
    last = tmp_path / "step=1.ckpt"
    again = run(mine, resume=last)  # the same objects, resumed
    fresh = run([AccumulationScheduler(schedule), GradientDecay(0.5)], resume=last)
    assert all(torch.equal(a, b) for a, b in zip(again, fresh, strict=True))


# ---------------------------------------------------------------------- a scheduler sized so on purpose
def cosine_restarts(optimizer: torch.optim.Optimizer) -> Any:
    """A cosine of 2 steps, meant to restart through a fit of more (not a length taken from the fit)."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2)


class AnotherWarning(pl.Callback):
    """Another `PossibleUserWarning` of the fit, which a filter on the horizon warning's category must leave."""

    def on_train_start(self, *args: Any) -> None:
        warnings.warn("another possible user warning", PossibleUserWarning, stacklevel=1)


def horizon_fit(adapter: str, budget: bool, silenced: bool) -> list[warnings.WarningMessage]:
    """A fit whose step-interval scheduler is sized on purpose (``cosine_restarts``), every warning recorded;
    ``silenced``: with the filter the warning names."""
    schedule: Any = Budget(30, unit="items") if budget else 2
    items: dict[str, Any] = {"normalize": "items", "count": count_tokens, "reduction": "sum"} if budget else {}
    reduction = "sum" if budget else "mean"
    if adapter == "callback":
        callbacks: list[pl.Callback] = [AccumulationScheduler(schedule, **items)]
        model: pl.LightningModule = TokenModel(reduction=reduction, scheduler=cosine_restarts)
    else:
        callbacks = []
        items.pop("reduction", None)  # (the mixin's model passes its own)
        model = ManualTokenModel(reduction=reduction, scheduler=cosine_restarts, schedule=schedule,
                                 step_schedulers=True, **items)  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if silenced:  # what the warning says to write
            warnings.filterwarnings("ignore", category=SchedulerHorizonWarning)
        trainer(callbacks=[*callbacks, AnotherWarning()], max_epochs=1).fit(model, loader(DATA, 4))
    return seen


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
@pytest.mark.parametrize("budget", [False, True])
def test_a_scheduler_sized_on_purpose_is_silenced_by_its_warning_category_alone(adapter: str, budget: bool) -> None:
    """The horizon warning (a length that is not the fit's steps; under a budget of items, a length that cannot be
    checked) says how to silence it: a `warnings` filter on `SchedulerHorizonWarning` (a `PossibleUserWarning`),
    which silences nothing else (another `PossibleUserWarning` still comes)."""
    said = "cannot be known at its start" if budget else "is sized for 2 steps, but this fit takes 3"
    warned = [w for w in horizon_fit(adapter, budget, silenced=False) if w.category is SchedulerHorizonWarning]
    assert len(warned) == 1 and "CosineAnnealingLR" in str(warned[0].message) and said in str(warned[0].message)
    assert "category=lightning_accum.SchedulerHorizonWarning" in str(warned[0].message)
    assert isinstance(warned[0].message, PossibleUserWarning) and isinstance(warned[0].message, UserWarning)
    seen = horizon_fit(adapter, budget, silenced=True)
    assert not [w for w in seen if issubclass(w.category, SchedulerHorizonWarning)]
    assert [str(w.message) for w in seen if w.category is PossibleUserWarning] == ["another possible user warning"]
