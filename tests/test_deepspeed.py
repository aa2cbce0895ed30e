"""``AccumulationScheduler`` under DeepSpeed (ZeRO stages 0, 1 and 2) against the float64
reference, on CPU.

Lightning's ``DeepSpeedStrategy`` refuses anything but CUDA; DeepSpeed itself runs on CPU (its
CPU accelerator, gloo). ``helpers.CPUDeepSpeed`` lifts Lightning's CUDA-only checks (private
overrides, test-only) so that the same engine calls run here: one rank, float32 (tolerance
1e-6: float32 rounding over 24 SGD steps of this small model stays near 1e-7). Each run is
spawned (see ``CPUDeepSpeed``). The same tests run on a GPU in ``tests/gpu/test_strategies.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import (
    AccumulationScheduler,
    Budget,
    Constant,
    GradientDecay,
    NoiseScale,
    Piecewise,
    Ramp,
    Schedule,
)
from lightning_accum.lr import WarmupLinear

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
        ([AccumulationScheduler(2, lr_schedule=WarmupLinear(2, 8, unit="step"))], r"lr_schedule=WarmupLinear"),
        (  # (a budget closes its windows where its count is reached; DeepSpeed steps at its own boundaries)
            [AccumulationScheduler(Budget(8, unit="samples"))],
            r"`AccumulationScheduler\(Budget\(8, unit='samples'\)\)` cannot run under `CPUDeepSpeed`: DeepSpeed's",
        ),
        ([AccumulationScheduler(NoiseScale(2, 8))], "`NoiseScale` cannot measure the gradient noise under DEEPSPEED"),
        ([AccumulationScheduler(2), GradientDecay(0.5)], "`GradientDecay` cannot run under `CPUDeepSpeed`"),
        (  # (DeepSpeed sums the window in its own buffers: its config's `data_types.grad_accum_dtype` does the job)
            [AccumulationScheduler(2, grad_accum_dtype="float32")],
            r"`grad_accum_dtype='float32'` cannot work here\. DeepSpeed .*"
            r"\"data_types\": \{\"grad_accum_dtype\": \"fp32\"\}",
        ),
    ],
)
def test_what_needs_the_gradient_after_backward_is_refused(tmp_path: Path, callbacks: list[Any], match: str) -> None:
    with pytest.raises(Exception, match=match):  # raised in the spawned rank, re-raised here
        fit(tmp_path, 2, callbacks)
    assert not (tmp_path / "started").exists()  # before any batch


class BatchNormModel(pl.LightningModule):
    """A ``BatchNorm1d`` on the input itself (what it is given does not depend on training), then a linear head;
    its running statistics written to ``out/bn{rank}.json`` at the fit's end."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.norm, self.head = torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return torch.nn.functional.mse_loss(self.head(self.norm(batch[0])), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        state = [self.norm.running_mean.tolist(), self.norm.running_var.tolist(), int(self.norm.num_batches_tracked)]
        (self.out / f"bn{self.global_rank}.json").write_text(json.dumps(state))


def test_window_batchnorm_statistics_under_deepspeed(tmp_path: Path) -> None:
    """DeepSpeed's engine runs the module's forward and leaves its buffers alone: ``batchnorm="window"`` gives
    each window's statistics as one batch (ZeRO stage 2, windows of 3, 3 and a short one of 1). (On 2 ranks each
    keeps its own: ``tests/distributed/test_deepspeed_ranks.py``.)"""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(28, 3, generator=g) * 2 + 1, torch.randn(28, 1, generator=g)
    strategy = CPUDeepSpeed(config=deepspeed_config(2), process_group_backend="gloo")
    callbacks = [AccumulationScheduler(3, batchnorm="window")]
    options: dict[str, Any] = {"precision": "32-true", "use_distributed_sampler": False, "max_epochs": 1}
    t = trainer(strategy=strategy, callbacks=callbacks, **options)
    t.fit(BatchNormModel(tmp_path), DataLoader(TensorDataset(x, y), batch_size=4))
    mean, var, tracked = json.loads((tmp_path / "bn0.json").read_text())
    ref = torch.nn.BatchNorm1d(3).double()
    with torch.no_grad():
        for window in x.double().split(12):
            ref(window)
    assert tracked == 3
    expected = [*ref.running_mean.tolist(), *ref.running_var.tolist()]
    assert max(abs(a - b) for a, b in zip(mean + var, expected, strict=True)) < 1e-6
