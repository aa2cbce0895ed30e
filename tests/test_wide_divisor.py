"""Under ``grad_accum_dtype`` each loss goes to backward divided by ``wide_divisor(k)``, the power of two at or above
k: exact in bf16 and fp16, and an fp16 micro-batch gradient stays in range as Lightning's division by k keeps it
(undivided, a window of finite micro-batch gradients overflowed: 80000 at k = 4). The loss Lightning hands
``on_train_batch_end`` is still divided by k."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler


class Scalar(pl.LightningModule):
    """One parameter ``w``; a micro-batch's loss is ``2 a w``: its gradient is ``2 a``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((1,), 0.75))
        self.stepped: list[float] = []
        self.outputs: list[float] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (a,) = batch
        return (a * self.w).sum() + (a * self.w).sum()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.stepped.append(float(self.w.grad))  # type: ignore[arg-type]

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.outputs.append(float(outputs["loss"]))  # type: ignore[index]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(dtype: torch.dtype | None, precision: str, a: list[float], k: int) -> Scalar:
    model = Scalar()
    trainer = pl.Trainer(
        max_epochs=1, precision=precision, callbacks=[AccumulationScheduler(k, grad_accum_dtype=dtype, log=False)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(torch.tensor(a)[:, None]), batch_size=1))
    return model


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_an_fp16_window_of_finite_gradients_stays_finite(dtype: torch.dtype | None) -> None:
    # a micro-batch gradient of 80000 (past fp16's 65504 undivided) in a window of 4 whose mean is 20001.5
    model = fit(dtype, "16-true", [40000.0, 1.0, 1.0, 1.0], k=4)
    assert model.stepped == [20000.0]  # (fp16's nearest to 20001.5; the same without the option)


@pytest.mark.parametrize("k", [3, 5])
def test_the_loss_the_batch_end_hooks_get_is_divided_by_k(k: int) -> None:
    a = [0.375, 1.25, -0.5, 2.0, 0.75][:k]
    without, wide = fit(None, "bf16-true", a, k), fit(torch.float32, "bf16-true", a, k)
    assert wide.outputs == without.outputs  # bit for bit: Lightning's own loss / k
    assert wide.stepped == without.stepped  # (here every sum is exact: the same step)
