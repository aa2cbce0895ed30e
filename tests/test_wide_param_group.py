"""``grad_accum_dtype`` for a param group added during the fit (``BaseFinetuning``'s way; found by the differential
fuzzer, issue 51): its bf16 parameters' window gradient is summed in float32 and rounded once, as the others' are,
from the micro-batch it joins at, a window under way included."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler

N, BATCH, K, JOINS = 16, 2, 8, 2  # one window of 8 micro-batches; the first layer joins at the third


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)


class Model(pl.LightningModule):
    """The first layer frozen and outside the optimizer until batch ``JOINS``, where it joins as a param group of its
    own; its ``.grad`` after each batch, and the window gradient the step gets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
        self.net[0].requires_grad_(False)
        self.between: list[Tensor | None] = []
        self.stepped: list[Tensor] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == JOINS:
            self.net[0].requires_grad_(True)
            self.optimizers().optimizer.add_param_group({"params": list(self.net[0].parameters())})  # type: ignore[union-attr]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if JOINS <= batch_idx < K - 1:
            self.between.append(self.net[0].weight.grad)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.stepped = [self.net[0].weight.grad.detach().clone(), self.net[2].weight.grad.detach().clone()]  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.1)


def _round_bf16(x: Tensor) -> Tensor:
    """``x`` (float64) rounded to the nearest bf16 number once, ties to even (torch's float64 -> bf16 goes through
    float32)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 256.0) / 256.0, exponent)


def test_a_param_group_joining_a_window_is_summed_in_float32() -> None:
    x, y = _data()
    model = Model()
    trainer = pl.Trainer(
        max_steps=1, precision="bf16-true", callbacks=[AccumulationScheduler(K, grad_accum_dtype="float32")],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    # between micro-batches the joined layer's gradient is in its float32 sum, not in a bf16 `.grad`
    assert model.between == [None] * (K - 1 - JOINS)
    # its window gradient: the exact mean of its micro-batch gradients (from the one it joined at), rounded once; and
    # the last layer's, whose sums held the window's first micro-batches as the group joined
    ref = Model().to(torch.bfloat16)
    ref.net[0].requires_grad_(True)
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in (ref.net[0].weight, ref.net[2].weight)]
    for j in range(K):
        ref.zero_grad()
        xb, yb = x[j * BATCH : (j + 1) * BATCH].bfloat16(), y[j * BATCH : (j + 1) * BATCH].bfloat16()
        nn.functional.mse_loss(ref.net(xb), yb).backward()
        if j >= JOINS:
            exact[0] += ref.net[0].weight.grad.double()  # type: ignore[union-attr]
        exact[1] += ref.net[2].weight.grad.double()  # type: ignore[union-attr]
    for got, want in zip(model.stepped, exact, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.double(), _round_bf16(want / K))
