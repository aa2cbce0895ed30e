"""``AccumulationScheduler`` under DeepSpeed (ZeRO stages 0, 1 and 2) against the float64
reference, on CPU.

Lightning's ``DeepSpeedStrategy`` refuses anything but CUDA; DeepSpeed itself runs on CPU (its
CPU accelerator, gloo). ``helpers.CPUDeepSpeed`` lifts Lightning's CUDA-only checks (private
overrides, test-only) so that the same engine calls run here: one rank, float32 (tolerance
1e-6: float32 rounding over 24 SGD steps of this small model stays near 1e-7). Each run is
spawned (see ``CPUDeepSpeed``). The same tests run on a GPU in ``tests/gpu/test_strategies.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_accum import AccumulationScheduler, Constant, GradientDecay, NoiseScale, Piecewise, Ramp, Schedule

from helpers import (
    CPUDeepSpeed,
    FileReport,
    Float32TokenModel,
    Reference,
    TokenData,
    count_tokens,
    deepspeed_config,
    loader,
    max_diff,
    rank_batches,
    trainer,
)

pytest.importorskip("deepspeed")


DATA = TokenData(50)  # 13 batches of 4: short last windows


def fit(tmp_path: Path, stage: int, callbacks: list[Any]) -> FileReport:
    accumulation = next((cb for cb in callbacks if isinstance(cb, AccumulationScheduler)), None)
    report = FileReport(tmp_path, accumulation)
    strategy = CPUDeepSpeed(config=deepspeed_config(stage), process_group_backend="gloo")
    t = trainer(strategy=strategy, precision="32-true", use_distributed_sampler=False, callbacks=[*callbacks, report])
    t.fit(Float32TokenModel(optimizer="plain-sgd"), loader(DATA, 4))
    return report


PIECEWISE, RAMP = Piecewise({0: 3, 4: 2}, unit="step"), Ramp(1, 4, over=60, unit="samples")


@pytest.mark.parametrize(
    ("stage", "schedule"),
    [(0, PIECEWISE), (1, RAMP), (2, PIECEWISE), (3, RAMP)],  # every stage, each schedule on two (a fit is ~10 s)
    ids=["0-step-piecewise", "1-samples-ramp", "2-step-piecewise", "3-samples-ramp"],
)
def test_matches_reference(tmp_path: Path, stage: int, schedule: Schedule) -> None:
    report = fit(tmp_path, stage, [AccumulationScheduler(schedule)])
    (result,) = report.read()
    expected, sizes = Reference(schedule, optimizer="plain-sgd").run([rank_batches(DATA, 4)] * 2)
    wrong, _ = Reference(schedule, optimizer="plain-sgd", short_window="full").run([rank_batches(DATA, 4)] * 2)
    assert max_diff(result["params"], expected) < 1e-6
    assert max_diff(wrong, expected) > 1e-3  # the short windows matter
    assert result["progress"]["step"] == result["engine_steps"] == len(sizes)  # the engine stepped once per window
    assert result["progress"]["samples"] == 2 * len(DATA)


def test_builtin_divides_twice_under_deepspeed(tmp_path: Path) -> None:
    """What the callback fixes: Lightning divides each loss by k and DeepSpeed's engine divides by
    its accumulation steps again, so `accumulate_grad_batches=k` steps with the mean over k^2."""
    k, data = 2, TokenData(48)
    report = FileReport(tmp_path)
    strategy = CPUDeepSpeed(config=deepspeed_config(2), process_group_backend="gloo")
    t = trainer(
        strategy=strategy,
        precision="32-true",
        use_distributed_sampler=False,
        callbacks=[report],
        max_epochs=1,
        accumulate_grad_batches=k,
    )
    t.fit(Float32TokenModel(optimizer="plain-sgd"), loader(data, 4))
    (result,) = report.read()
    epochs = [rank_batches(data, 4)]
    expected, _ = Reference(Constant(k), optimizer="plain-sgd").run(epochs)
    halved, _ = Reference(Constant(k), optimizer="plain-sgd", lr=0.1 / k).run(epochs)  # plain SGD: lr / k == grad / k
    assert max_diff(result["params"], halved) < 1e-6
    assert max_diff(result["params"], expected) > 1e-3


@pytest.mark.parametrize(
    ("callbacks", "match"),
    [
        ([AccumulationScheduler(2, normalize="items", reduction="sum", count=count_tokens)], r"normalize='items'"),
        ([AccumulationScheduler(2, lr_scaling="sqrt")], r"lr_scaling='sqrt'"),
        ([AccumulationScheduler(NoiseScale(2, 8))], "`NoiseScale` cannot measure the gradient noise under DEEPSPEED"),
        ([AccumulationScheduler(2), GradientDecay(0.5)], "`GradientDecay` cannot run under `CPUDeepSpeed`"),
    ],
)
def test_what_needs_the_gradient_after_backward_is_refused(tmp_path: Path, callbacks: list[Any], match: str) -> None:
    with pytest.raises(Exception, match=match):  # raised in the spawned rank, re-raised here
        fit(tmp_path, 2, callbacks)
    assert not (tmp_path / "started").exists()  # before any batch
