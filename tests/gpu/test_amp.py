"""CUDA mixed precision: the callback, the mixin and GradientDecay against a float32 reference.

Skipped without CUDA. Run on a GPU machine with ``bash tests/gpu/run.sh``.

Tolerance: the model runs its matmuls in float16 (or bfloat16) under autocast, so each
micro-batch gradient carries a relative error of about 2^-11 (2^-8 for bf16) against the
float32 reference; over a few dozen SGD steps of a small, well-conditioned model that stays
below 1e-2 absolute on the parameters, while a normalisation error (a short window divided by
k, a loss scale left in the gradient, a residual mixing scales) moves them by 1e-1 or more.
Each test also checks that the run is far closer to the true reference than to a wrong one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_helpers import precision_plugins

from lightning_accum import AccumulationScheduler, GradientDecay, Piecewise

from helpers import (
    Float32ManualTokenModel,
    Float32TokenModel,
    Reference,
    TokenData,
    loader,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")
DATA = TokenData(50)  # 13 batches of 4: short last windows


def gpu_trainer(precision: str, **kwargs: Any) -> Any:
    return trainer(accelerator="gpu", devices=1, **precision_plugins(precision), **kwargs)


def check(model: torch.nn.Module, decay: tuple[float, str, bool] | None = None, tol: float = 1e-2) -> None:
    epochs = [rank_batches(DATA, 4)] * 2
    expected, _ = Reference(SCHEDULE, decay=decay).run(epochs)
    wrong, _ = Reference(SCHEDULE, decay=decay, short_window="full").run(epochs)
    got = [p.detach().double().cpu() for p in params_of(model)]
    error = max_diff(got, expected)
    assert error < tol
    assert error < 0.25 * max_diff(wrong, expected)


def data32() -> Any:
    # the reference is float64; the GPU runs train a float32 model on float32 inputs
    return loader(DATA, 4)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_callback(precision: str) -> None:
    model = Float32TokenModel()
    gpu_trainer(precision, callbacks=[AccumulationScheduler(SCHEDULE)], max_epochs=2).fit(model, data32())
    check(model)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["backward", "heads"])
def test_mixin(precision: str, mode: str) -> None:
    model = Float32ManualTokenModel(schedule=SCHEDULE, mode=mode)
    gpu_trainer(precision, max_epochs=2).fit(model, data32())
    check(model)


def test_decay_with_grad_scaler() -> None:
    """The residual is combined after unscaling: it never carries the loss scale."""
    model = Float32TokenModel()
    callbacks = [AccumulationScheduler(SCHEDULE), GradientDecay(0.8)]
    gpu_trainer("16-mixed", callbacks=callbacks, max_epochs=2).fit(model, data32())
    check(model, decay=(0.8, "sum", False), tol=2e-2)  # the residual carries earlier rounding forward


def test_default_scaler_as_lightnings_own() -> None:
    """With the GradScaler Lightning makes (2^16 at first: these models' float16 gradients overflow and
    their first steps are skipped), the callback steps, skips and rescales as Lightning's own
    ``accumulate_grad_batches`` does on full windows."""
    data = loader(TokenData(48), 4)  # 12 batches: windows of 2, none short
    ours, builtin = Float32TokenModel(), Float32TokenModel()
    trainer(accelerator="gpu", devices=1, precision="16-mixed", callbacks=[AccumulationScheduler(2)]).fit(ours, data)
    trainer(accelerator="gpu", devices=1, precision="16-mixed", accumulate_grad_batches=2).fit(builtin, data)
    got, want = ([p.detach().double().cpu() for p in params_of(m)] for m in (ours, builtin))
    assert max_diff(got, want) <= 1e-6
