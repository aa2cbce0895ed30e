"""AccumulationScheduler against the float64 reference loop of tests/helpers.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_accum import AccumulationScheduler, Constant, Lambda, Piecewise, Ramp, Schedule

from helpers import (
    KRecorder,
    Reference,
    TokenData,
    TokenModel,
    count_tokens,
    loader,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

TOL = 1e-12


def fit(
    schedule: Schedule,
    data: TokenData,
    batch_size: int,
    epochs: int,
    normalize: str = "mean",
    model_kwargs: dict[str, Any] | None = None,
    callback_kwargs: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> tuple[TokenModel, KRecorder, AccumulationScheduler]:
    model = TokenModel(reduction="sum" if normalize == "items" else "mean", **(model_kwargs or {}))
    recorder = KRecorder()
    kwargs = dict(normalize=normalize, count=count_tokens if normalize == "items" else None)
    kwargs["reduction"] = "sum" if normalize == "items" else None
    kwargs.update(callback_kwargs or {})
    callback = AccumulationScheduler(schedule, **kwargs)
    t = trainer(callbacks=[callback, recorder], max_epochs=epochs, **trainer_kwargs)
    t.fit(model, loader(data, batch_size))
    assert t.global_step == len(recorder.windows)
    return model, recorder, callback


SCHEDULES = {
    "constant": Constant(3),
    "epoch": Piecewise({0: 2, 1: 3, 2: 5}, unit="epoch"),
    "step_mid_epoch": Piecewise({0: 3, 4: 2, 9: 4}, unit="step"),
    "samples_ramp": Ramp(1, 6, over=120, unit="samples"),
    "exp_ramp_by_step": Ramp(1, 8, over=10, unit="step", shape="exponential"),
    "items": Piecewise({0: 1, 150: 3, 400: 4}, unit="items"),
    "lambda_odd": Lambda(lambda p: 1 + (p.step * 7) % 5),
    "k_exceeds_epoch": Constant(20),
}


@pytest.mark.parametrize("normalize", ["mean", "items"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_matches_reference(name: str, normalize: str) -> None:
    """Windows exactly as scheduled (mid-epoch changes, short last windows and a short last
    batch included) and the stepped gradient equal to the hand-made window's normalised gradient."""
    schedule = SCHEDULES[name]
    data = TokenData(50)  # 13 batches of 4, the last one holds 2
    kwargs = {} if name != "items" or normalize == "items" else {"count": count_tokens}
    model, recorder, callback = fit(schedule, data, 4, epochs=3, normalize=normalize, callback_kwargs=kwargs)
    expected, sizes = Reference(schedule, normalize=normalize).run([rank_batches(data, 4)] * 3)
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) <= TOL
    assert callback.progress.step == len(sizes)
    assert callback.progress.samples == 3 * len(data)
    assert callback.progress.microbatches == 3 * 13


def test_builtin_underweights_short_last_window() -> None:
    """Why the callback exists: Lightning's built-in accumulation divides a short last window
    by the full k. It matches a reference that does the same, and misses the true mean."""
    data = TokenData(40)  # 10 batches of 4: windows of 4, 4, 2
    model = TokenModel()
    t = trainer(accumulate_grad_batches=4, max_epochs=2)
    t.fit(model, loader(data, 4))
    epochs = [rank_batches(data, 4)] * 2
    underweighted, _ = Reference(Constant(4), short_window="full").run(epochs)
    true_mean, _ = Reference(Constant(4)).run(epochs)
    assert max_diff(params_of(model), underweighted) <= TOL
    assert max_diff(params_of(model), true_mean) > 1e-4

    ours, _, _ = fit(Constant(4), data, 4, epochs=2)
    assert max_diff(params_of(ours), true_mean) <= TOL


def test_dict_schedule_matches_lightning_on_full_windows() -> None:
    """A dict schedule is a drop-in for GradientAccumulationScheduler where the built-in is exact."""
    data = TokenData(48)  # 12 batches: every window is full for k in {2, 3, 4}
    builtin = TokenModel()
    trainer(callbacks=[GradientAccumulationScheduler({0: 2, 1: 3, 2: 4})], max_epochs=3).fit(builtin, loader(data, 4))
    ours, _, _ = fit({0: 2, 1: 3, 2: 4}, data, 4, epochs=3)  # type: ignore[arg-type]
    assert max_diff(params_of(ours), params_of(builtin)) <= TOL


def test_items_is_token_weighted_not_mean_of_means() -> None:
    data = TokenData(48)
    items, _, _ = fit(Constant(4), data, 4, epochs=2, normalize="items")
    mean_of_means, _, _ = fit(Constant(4), data, 4, epochs=2, normalize="mean")
    expected, _ = Reference(Constant(4), normalize="items").run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(items), expected) <= TOL
    assert max_diff(params_of(mean_of_means), expected) > 1e-4


@pytest.mark.parametrize("lr_scaling", [None, "linear", "sqrt"])
@pytest.mark.parametrize("frequency", [1, 2])
def test_lr_scheduler_and_scaling(lr_scaling: str | None, frequency: int) -> None:
    """Step-interval schedulers step once per optimizer step (``frequency`` counts optimizer
    steps), and the LR scaling multiplies the scheduled LR for the step only (a chainable
    scheduler would compound it otherwise)."""
    schedule = Ramp(1, 4, over=8, unit="step")
    data = TokenData(50)

    def scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)

    model_kwargs = dict(scheduler=scheduler, scheduler_frequency=frequency, optimizer="adam", lr=0.01)
    model, recorder, _ = fit(
        schedule, data, 4, epochs=3, model_kwargs=model_kwargs, callback_kwargs={"lr_scaling": lr_scaling}
    )
    reference = Reference(
        schedule,
        scheduler=scheduler,
        scheduler_frequency=frequency,
        optimizer="adam",
        lr=0.01,
        lr_scaling=lr_scaling,
    )
    expected, sizes = reference.run([rank_batches(data, 4)] * 3)
    assert recorder.windows == sizes
    assert max_diff(params_of(model), expected) <= TOL
    steps = len(sizes)
    assert model.trainer.lr_scheduler_configs[0].frequency == frequency  # the user's config is left as it was
    lr = model.trainer.optimizers[0].param_groups[0]["lr"]
    assert math.isclose(lr, 0.01 * 0.7 ** ((steps // frequency) // 3), rel_tol=1e-12)


def test_clipping_acts_on_the_normalised_window_gradient() -> None:
    schedule = Piecewise({0: 3, 5: 2}, unit="step")
    data = TokenData(50)
    model, _, _ = fit(schedule, data, 4, epochs=2, gradient_clip_val=0.05)
    expected, _ = Reference(schedule, clip=0.05).run([rank_batches(data, 4)] * 2)
    assert max_diff(params_of(model), expected) <= TOL
    unclipped, _ = Reference(schedule).run([rank_batches(data, 4)] * 2)
    assert max_diff(expected, unclipped) > 1e-4  # the clip really bit


def test_bf16_mixed_on_cpu() -> None:
    """bf16 autocast changes the forward's rounding only; windows and normalisation stay exact,
    so the run stays within bf16 rounding of the float64 reference (and far from a wrong one)."""
    schedule = Piecewise({0: 3, 4: 2}, unit="step")
    data = TokenData(50)
    model, recorder, _ = fit(schedule, data, 4, epochs=2, precision="bf16-mixed")
    expected, sizes = Reference(schedule).run([rank_batches(data, 4)] * 2)
    underweighted, _ = Reference(schedule, short_window="full").run([rank_batches(data, 4)] * 2)
    assert recorder.windows == sizes
    error = max_diff([p.double() for p in params_of(model)], expected)
    assert error < 2e-2
    assert error < 0.5 * max_diff(underweighted, expected)


def test_logs_progress() -> None:
    data = TokenData(48)
    model, recorder, callback = fit(Ramp(1, 4, over=6, unit="step"), data, 4, epochs=1, log_every_n_steps=1)
    assert recorder.windows == [1, 1, 2, 2, 3, 3]  # 12 batches: the last window is k=3
    metrics = model.trainer.callback_metrics
    assert float(metrics["accum/k"]) == 3.0
    assert float(metrics["accum/samples"]) == 48.0 == callback.progress.samples
    assert float(metrics["accum/items"]) == 48.0
    assert float(metrics["accum/effective_batch"]) == 3.0 * 4
    assert "accum/k" in model.trainer.progress_bar_metrics


def test_trainer_is_left_as_found() -> None:
    data = TokenData(20)
    model, _, _ = fit(Piecewise({0: 3, 2: 2}, unit="step"), data, 4, epochs=1)
    assert model.trainer.accumulate_grad_batches == 1


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(schedule=0), "int >= 1"),
        (dict(schedule=2.5), "must be a Schedule"),
        (dict(schedule={}), "empty"),
        (dict(schedule=3, normalize="tokens"), "normalize"),
        (dict(schedule=3, normalize="items"), "needs `count`"),
        (dict(schedule=3, count=5), "`count` must be a function"),
        (dict(schedule=3, lr_scaling="cubic"), "lr_scaling"),
        (dict(schedule=Ramp(1, 4, over=100, unit="items")), "needs `count`"),
        (dict(schedule=3, reduction="none"), "`reduction` must be 'sum' or 'mean'"),
        (dict(schedule=3, reduction="mean"), "only `normalize='items'` .* uses"),
        (dict(schedule=3, reduction="sum"), "only `normalize='items'` .* uses"),
    ],
)
def test_construction_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        AccumulationScheduler(**kwargs)


class ManualModel(TokenModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("model", "callbacks", "trainer_kwargs", "match"),
    [
        (ManualModel, [AccumulationScheduler(2)], {}, "AccumulationMixin"),
        (
            TokenModel,
            [AccumulationScheduler(2)],
            {"accumulate_grad_batches": 2},
            "remove `accumulate_grad_batches`",
        ),
        # Lightning itself refuses two stateful callbacks of one type, at `Trainer(...)`
        (
            TokenModel,
            [AccumulationScheduler(2), AccumulationScheduler(3)],
            {},
            "more than one stateful callback",
        ),
        (TokenModel, [AccumulationScheduler(2), GradientAccumulationScheduler({0: 2})], {}, "Only one"),
    ],
)
def test_fit_start_errors(model: type, callbacks: list[Any], trainer_kwargs: dict[str, Any], match: str) -> None:
    m = model()
    before = params_of(m)
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer(callbacks=callbacks, **trainer_kwargs).fit(m, loader(TokenData(8), 4))
    assert max_diff(params_of(m), before) == 0.0  # no step was taken


def test_deepspeed_with_items_is_refused_early() -> None:
    """DeepSpeed is supported with `normalize="mean"` (tests/test_deepspeed.py); the global item
    count is only known after backward, when DeepSpeed's gradient is out of reach."""

    class FakeDeepSpeed:
        handles_gradient_accumulation = True

    class FakeTrainer:
        strategy = FakeDeepSpeed()
        accumulate_grad_batches = 1
        callbacks: list[Any] = []

    callback = AccumulationScheduler(2, normalize="items", reduction="sum", count=count_tokens)
    with pytest.raises(RuntimeError, match=r"\(normalize='items'\) cannot run under `FakeDeepSpeed`"):
        callback.on_fit_start(FakeTrainer(), TokenModel())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2.5, "3", torch.tensor(-2), torch.tensor(1.5)])
def test_bad_count_at_run_time(bad: Any) -> None:
    callback = AccumulationScheduler(2, normalize="items", reduction="sum", count=lambda batch: bad)
    with pytest.raises(ValueError, match=r"item count \((from|the window's tensor count 0, from) `count\(batch\)`"):
        trainer(callbacks=[callback], max_epochs=1).fit(TokenModel(reduction="sum"), loader(TokenData(8), 4))


def test_a_callback_reused_for_another_fit_goes_on_from_its_progress() -> None:
    """A new Trainer, no checkpoint: the callback keeps its progress (as Lightning's callbacks keep their state
    across fits, and the mixin's model its `accumulation_progress`), so a schedule by steps goes on."""
    schedule = Piecewise({0: 1, 4: 3}, unit="step")
    accumulation, recorder, model = AccumulationScheduler(schedule), KRecorder(), TokenModel(optimizer="plain-sgd")
    for _ in range(2):  # (each fit makes its optimizer afresh: one without state)
        trainer(callbacks=[accumulation, recorder], max_epochs=1).fit(model, loader(TokenData(32), 4))
    expected, sizes = Reference(schedule, optimizer="plain-sgd").run([rank_batches(TokenData(32), 4)] * 2)
    assert recorder.windows == sizes == [1, 1, 1, 1, 3, 1, 3, 3, 2]
    assert max_diff(params_of(model), expected) <= TOL
    assert (accumulation.progress.step, accumulation.progress.samples) == (len(sizes), 64)
    fresh, recorder = AccumulationScheduler(schedule), KRecorder()  # a new callback starts afresh
    trainer(callbacks=[fresh, recorder], max_epochs=1).fit(TokenModel(), loader(TokenData(32), 4))
    assert recorder.windows == sizes[:6] and fresh.progress.step == 6
