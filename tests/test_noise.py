"""Gradient noise scale: the estimator against closed-form truth, the schedule, and the plumbing
of the callback and the mixin against a hand-made reference of the same measurements."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import KRecorder, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler, NoiseScale, NoiseScaleEstimator, Progress

D, SIGMA = 10, 1.0


def regression(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ~ N(0, I_d), y = x . w* + N(0, sigma^2); the model starts at w* + delta with |delta| = 1."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = x @ w_star + SIGMA * torch.randn(n, generator=g, dtype=torch.float64)
    delta = torch.randn(D, generator=g, dtype=torch.float64)
    return x, y, w_star + delta / delta.norm()


# per-sample gradient g = x (x . delta - eps): |G|^2 = |delta|^2 = 1, tr(Sigma) = (d + 1) |delta|^2 + d sigma^2
TRUE_GRAD_SQ, TRUE_TRACE = 1.0, (D + 1) * 1.0 + D * SIGMA**2


def test_estimator_recovers_closed_form_truth() -> None:
    n, b, k, beta = 4000, 16, 8, 0.999
    x, y, w = regression(n * b * k)
    per_sample = x * (x @ w - y)[:, None]  # (n, d)
    small = per_sample.view(n, k, b, D)[:, 0].mean(1).square().sum(1)  # first micro-batch of each window
    big = per_sample.view(n, k * b, D).mean(1).square().sum(1)
    est = NoiseScaleEstimator(beta=beta)
    for s_sq, b_sq in zip(small.tolist(), big.tolist(), strict=True):
        est.update(s_sq, b, b_sq, b * k)
    assert est.grad_sq / (1 - beta**n) == pytest.approx(TRUE_GRAD_SQ, rel=0.1)
    assert est.trace / (1 - beta**n) == pytest.approx(TRUE_TRACE, rel=0.1)
    assert est.noise_scale == pytest.approx(TRUE_TRACE / TRUE_GRAD_SQ, rel=0.1)


def test_estimator_ignores_unusable_measurements() -> None:
    est = NoiseScaleEstimator()
    est.update(1.0, 4, 1.0, 4)  # equal batch sizes
    est.update(float("nan"), 4, 1.0, 8)
    assert est.updates == 0 and math.isnan(est.noise_scale)


def test_schedule_every_warmup_hysteresis_and_state() -> None:
    s = NoiseScale(2, 16, every=3, warmup=2, hysteresis=0.2, beta=0.0)
    obs = dict(small_sq=1 + 64 / 8, small_batch=8, big_sq=1 + 64 / 16, big_batch=16, per_microbatch=8)
    s.observe(**obs)
    assert s(Progress(step=5)) == 2  # warm-up: one measurement only
    s.observe(**obs)
    assert s(Progress(step=2)) == 2  # fewer than `every` steps since the last change (at 0)
    assert s(Progress(step=3)) == 8  # B_simple 64 / 8 per micro-batch
    s.observe(**{**obs, "small_sq": 1 + 72 / 8, "big_sq": 1 + 72 / 16})  # B_simple 72: k 9, within hysteresis
    assert s(Progress(step=10)) == 8
    clone = NoiseScale(2, 16, every=3, warmup=2, hysteresis=0.2, beta=0.0)
    clone.load_state_dict(s.state_dict())
    assert clone(Progress(step=10)) == 8 and clone.noise_scale == s.noise_scale
    assert eval(repr(s)) == NoiseScale(2, 16, every=3, warmup=2, hysteresis=0.2, beta=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_k=0, max_k=4), "min_k"),
        (dict(min_k=1, max_k=4), "measures nothing"),
        (dict(min_k=4, max_k=2), "below `min_k`"),
        (dict(min_k=2, max_k=4, start=8), "`start`"),
        (dict(min_k=2, max_k=4, hysteresis=1.5), "hysteresis"),
        (dict(min_k=2, max_k=4, beta=1.0), "beta"),
    ],
)
def test_schedule_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NoiseScale(**kwargs)


class Regressor(pl.LightningModule):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return 0.5 * (x @ self.w - y).square().mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # G and Sigma stay fixed: a known target


class ManualRegressor(AccumulationMixin, Regressor):
    def __init__(self, w: torch.Tensor, schedule: NoiseScale) -> None:
        super().__init__(w)
        self.configure_accumulation(schedule)

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(self.loss(batch))


def reference_estimator(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, windows: list[int], b: int
) -> NoiseScaleEstimator:
    """The same measurements, by hand: first micro-batch's gradient and the window's mean gradient."""
    est = NoiseScaleEstimator(beta=0.9)
    grads = (x * (x @ w - y)[:, None]).view(-1, b, D).mean(1)  # per micro-batch mean gradients
    i = 0
    for k in windows:
        if k > 1:
            est.update(grads[i].square().sum().item(), b, grads[i : i + k].mean(0).square().sum().item(), k * b)
        i += k
    return est


@pytest.mark.parametrize("manual", [False, True])
def test_plumbing_matches_reference_and_k_follows_the_noise_scale(manual: bool) -> None:
    x, y, w = regression(2400)
    schedule = NoiseScale(2, 16, every=5, warmup=10, beta=0.9)
    recorder = KRecorder()
    callbacks: list[Any] = [recorder]
    if manual:
        model: Regressor = ManualRegressor(w, schedule)
    else:
        model = Regressor(w)
        callbacks.insert(0, AccumulationScheduler(schedule))
    t = trainer(callbacks=callbacks, max_epochs=1)
    t.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    expected = reference_estimator(x, y, w, recorder.windows, 4)
    assert schedule.estimator.grad_sq == pytest.approx(expected.grad_sq, rel=1e-9)
    assert schedule.estimator.trace == pytest.approx(expected.trace, rel=1e-9)
    assert schedule.noise_scale == pytest.approx(TRUE_TRACE / TRUE_GRAD_SQ, rel=0.3)
    assert max(recorder.windows) > 2  # k moved from min_k towards B_simple / 4 = 5.25
    assert "accum/noise_scale" in model.trainer.callback_metrics
