"""``16-mixed`` with a real GradScaler, on CPU (Lightning's ``MixedPrecision`` plugin with
``torch.amp.GradScaler("cpu")``): the same code path as on CUDA, where it also runs in
``tests/gpu/test_amp.py``.

The window's gradient is unscaled once, by Lightning, before the package rescales, decays or
clips it. A step the scaler skips for inf/nan **counts**: the window's samples were consumed and
Lightning's ``global_step`` advances, so the schedule's step and sample counts stay in line with
the Trainer's; the parameters, the optimizer state and a decay residual are left as they were.

Tolerance: float16 autocast rounds each matmul to about 2^-11 relative; over two epochs of SGD
on this small model the parameters stay within 1e-2 of the float64 reference, while a wrong
normalisation or a step that was not skipped moves them several times further (checked).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_accum import AccumulationScheduler, GradientDecay, Piecewise

from helpers import (
    Float32ManualTokenModel,
    Float32TokenModel,
    KRecorder,
    Reference,
    TokenData,
    loader,
    max_diff,
    params_of,
    rank_batches,
    trainer,
)

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")  # k changes at step 4
DATA = TokenData(50)  # 13 batches of 4: short last windows
INF_AT = (0, 4)  # epoch 0, batch 4: inside the second window (batches 3-5)
SKIPPED = (1,)


INIT_SCALE = 2.0**8  # the default 2^16 overflows float16 gradients of this model now and then: one skip only


def fp16_trainer(**kwargs: Any) -> tuple[Any, MixedPrecision]:
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))
    return trainer(precision=None, plugins=[plugin], max_epochs=2, **kwargs), plugin


def check(model: Any, reference: Reference, wrong: Reference, tol: float = 1e-2) -> list[int]:
    epochs = [rank_batches(DATA, 4)] * 2
    expected, sizes = reference.run(epochs)
    other, _ = wrong.run(epochs)
    error = max_diff([p.detach().double() for p in params_of(model)], expected)
    assert error < tol
    assert error < 0.25 * max_diff(other, expected)
    return sizes


@pytest.mark.parametrize("inf_at", [None, INF_AT])
def test_callback(inf_at: tuple[int, int] | None) -> None:
    model, recorder, callback = Float32TokenModel(inf_at=inf_at), KRecorder(), AccumulationScheduler(SCHEDULE)
    t, plugin = fp16_trainer(callbacks=[callback, recorder])
    t.fit(model, loader(DATA, 4))
    skipped = SKIPPED if inf_at else ()
    wrong = Reference(SCHEDULE, short_window="full", skipped=skipped) if not inf_at else Reference(SCHEDULE)
    sizes = check(model, Reference(SCHEDULE, skipped=skipped), wrong)
    assert recorder.windows == sizes  # the skipped step counted: k changed at the same window
    assert callback.progress.step == t.global_step == len(sizes)
    assert callback.progress.samples == 2 * len(DATA)  # the skipped window's samples are not lost
    assert plugin.scaler.get_scale() == INIT_SCALE / (2 if inf_at else 1)  # exactly the one skip


@pytest.mark.parametrize("mode", ["backward", "heads"])
def test_mixin_skipped_step_counts(mode: str) -> None:
    model = Float32ManualTokenModel(inf_at=INF_AT, mode=mode, schedule=SCHEDULE)
    t, plugin = fp16_trainer()
    t.fit(model, loader(DATA, 4))
    sizes = check(model, Reference(SCHEDULE, skipped=SKIPPED), Reference(SCHEDULE))
    assert model.accumulation_progress.step == len(sizes)
    assert model.accumulation_progress.samples == 2 * len(DATA)
    assert plugin.scaler.get_scale() == INIT_SCALE / 2


def test_decay_keeps_the_last_stepped_residual_over_a_skipped_step() -> None:
    model = Float32TokenModel(inf_at=INF_AT)
    t, _ = fp16_trainer(callbacks=[AccumulationScheduler(SCHEDULE), GradientDecay(0.8)])
    t.fit(model, loader(DATA, 4))
    decay = (0.8, "sum", False)
    check(model, Reference(SCHEDULE, decay=decay, skipped=SKIPPED), Reference(SCHEDULE, decay=decay), tol=2e-2)
