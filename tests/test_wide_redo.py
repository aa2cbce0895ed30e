"""``grad_accum_dtype`` when an auto-sized window is redone (found by the differential fuzzer, issue 51).

An out-of-memory error in a backward pass leaves part of its gradient in the window, so ``microbatch_size="auto"``
(the callback) and ``backward_microbatches(size="auto")`` (the mixin) redo the window from its start at half the size.
Under ``grad_accum_dtype`` a narrow parameter's gradient is in the wide sums, not in ``.grad``: the redo must start
them from the window's start too. Each run that backs off is compared with the run at the size it found (the same
pieces, summed in the same order), bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler

N, BATCH, K = 16, 4, 2  # 4 loader batches of 4 samples, windows of 2: two steps


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(N, 3, generator=g), torch.randn(N, 1, generator=g)), batch_size=BATCH)


def _out_of_memory(grad: Tensor) -> Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


class Model(pl.LightningModule):
    """A piece of more than ``above`` samples runs out of memory in its backward pass, after the last layer's
    gradient is in (``above=None``: never); each step's gradient is kept."""

    def __init__(self, above: int | None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        self.above = above
        self.seen: list[list[Tensor]] = []

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        hidden = self.net[0](x)
        if self.above is not None and len(x) > self.above:
            hidden.register_hook(_out_of_memory)
        return nn.functional.mse_loss(self.net[2](self.net[1](hidden)), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(*batch)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.detach().clone() for p in self.parameters()])  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(AccumulationMixin, Model):
    def __init__(self, above: int | None, size: int | str) -> None:
        super().__init__(above)
        self.size = size
        self.configure_accumulation(K, grad_accum_dtype="float32")

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward_microbatches(lambda part: self.loss(*part), size=self.size)


def _fit(model: pl.LightningModule, callbacks: list[pl.Callback]) -> list[list[Tensor]]:
    trainer = pl.Trainer(
        max_epochs=1, precision="bf16-true", callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the back-off's own warning)
        trainer.fit(model, _data())
    return model.seen  # type: ignore[return-value]


def _same(a: list[list[Tensor]], b: list[list[Tensor]]) -> None:
    assert len(a) == len(b) == N // BATCH // K
    for step_a, step_b in zip(a, b, strict=True):
        for x, y in zip(step_a, step_b, strict=True):
            assert x.dtype == torch.bfloat16
            assert torch.equal(x, y), (x, y)


@pytest.mark.parametrize("above", [2, 1])
def test_callback_auto_redone_window_is_the_window_at_the_size_found(above: int) -> None:
    found = _fit(Model(above), [AccumulationScheduler(K, microbatch_size="auto", grad_accum_dtype="float32")])
    plain = _fit(Model(None), [AccumulationScheduler(K, microbatch_size=above, grad_accum_dtype="float32")])
    _same(found, plain)


@pytest.mark.parametrize("above", [2, 1])
def test_mixin_auto_redone_window_is_the_window_at_the_size_found(above: int) -> None:
    _same(_fit(Manual(above, "auto"), []), _fit(Manual(None, above), []))
