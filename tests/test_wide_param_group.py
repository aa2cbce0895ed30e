"""``grad_accum_dtype`` for a param group added during the fit (``BaseFinetuning``'s way; found by the differential
fuzzer, issue 51): its bf16 parameters' window gradient is summed in float32 and rounded once, as the others' are,
from the micro-batch it joins at, a window under way included, in every adapter."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler
from lightning_accum.fabric import FabricAccumulator

N, BATCH, K, JOINS = 16, 2, 8, 2  # one window of 8 micro-batches; the first layer joins at the third


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)


def _net() -> nn.Sequential:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    net[0].requires_grad_(False)  # (frozen, and outside the optimizer, until it joins)
    return net


def _join(net: nn.Module, optimizer: Any) -> None:
    net[0].requires_grad_(True)
    getattr(optimizer, "optimizer", optimizer).add_param_group({"params": list(net[0].parameters())})


class Model(pl.LightningModule):
    """The first layer joins the optimizer at batch ``JOINS``; its ``.grad`` after each batch inside the window, and
    the window gradients the step gets (the joined layer's, the last layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.between: list[Tensor | None] = []
        self.stepped: list[Tensor] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == JOINS:
            _join(self.net, self.optimizers())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if JOINS <= batch_idx < K - 1:
            self.between.append(self.net[0].weight.grad)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.stepped = [self.net[i].weight.grad.detach().clone() for i in (0, 2)]  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[2].parameters(), lr=0.1)


class Manual(AccumulationMixin, Model):
    def __init__(self) -> None:
        super().__init__()
        self.configure_accumulation(K, grad_accum_dtype="float32")

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def _trainer(model: pl.LightningModule, callbacks: list[pl.Callback]) -> tuple[list[Tensor | None], list[Tensor]]:
    x, y = _data()
    trainer = pl.Trainer(
        max_steps=1, precision="bf16-true", callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return model.between, model.stepped  # type: ignore[return-value]


def _fabric() -> tuple[list[Tensor | None], list[Tensor]]:
    x, y = _data()
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net[2].parameters(), lr=0.1))
    acc = FabricAccumulator(fabric, model, optimizer, K, grad_accum_dtype="float32", log=False)
    between: list[Tensor | None] = []
    stepped: list[Tensor] = []
    optimizer.register_step_pre_hook(lambda *_: stepped.extend(net[i].weight.grad.clone() for i in (0, 2)))
    for j in range(K):
        if j == JOINS:
            _join(net, optimizer)
        xb, yb = x[j * BATCH : (j + 1) * BATCH], y[j * BATCH : (j + 1) * BATCH]
        with acc.accumulate((xb, yb)) as step:
            step.backward(nn.functional.mse_loss(model(xb), yb.bfloat16()))
        if JOINS <= j < K - 1:
            between.append(net[0].weight.grad)
    return between, stepped


def _round_bf16(x: Tensor) -> Tensor:
    """``x`` (float64) rounded to the nearest bf16 number once, ties to even (torch's float64 -> bf16 goes through
    float32)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 256.0) / 256.0, exponent)


@pytest.mark.parametrize("adapter", ["callback", "mixin", "fabric"])
def test_a_param_group_joining_a_window_is_summed_in_float32(adapter: str) -> None:
    if adapter == "callback":
        between, stepped = _trainer(Model(), [AccumulationScheduler(K, grad_accum_dtype="float32")])
    elif adapter == "mixin":
        between, stepped = _trainer(Manual(), [])
    else:
        between, stepped = _fabric()
    # between micro-batches the joined layer's gradient is in its float32 sum, not in a bf16 `.grad`
    assert between == [None] * (K - 1 - JOINS)
    # its window gradient: the exact mean of its micro-batch gradients (from the one it joined at), rounded once; and
    # the last layer's, whose sums held the window's first micro-batches as the group joined
    x, y = _data()
    ref = _net().to(torch.bfloat16)
    ref[0].requires_grad_(True)
    exact = [torch.zeros_like(ref[i].weight, dtype=torch.float64) for i in (0, 2)]
    for j in range(K):
        ref.zero_grad()
        xb, yb = x[j * BATCH : (j + 1) * BATCH].bfloat16(), y[j * BATCH : (j + 1) * BATCH].bfloat16()
        nn.functional.mse_loss(ref(xb), yb).backward()
        if j >= JOINS:
            exact[0] += ref[0].weight.grad.double()  # type: ignore[union-attr]
        exact[1] += ref[2].weight.grad.double()  # type: ignore[union-attr]
    assert len(stepped) == 2
    for got, want in zip(stepped, exact, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.double(), _round_bf16(want / K))
