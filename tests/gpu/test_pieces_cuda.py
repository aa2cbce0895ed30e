"""``AccumulationScheduler(microbatch_size=...)`` on CUDA: 16-mixed with its GradScaler, and real
out-of-memory errors (a piece of n samples allocates n * 0.3 of a 4 GiB cap on the process's CUDA memory, for a
moment, in its forward or inside its backward): "auto" backs off to 2 and the run equals the float64
reference.

Skipped without CUDA. Run on a GPU machine with ``bash tests/gpu/run.sh``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpu_helpers import memory_cap, per_sample_bytes, precision_plugins
from torch import Tensor

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import (
    Float32TokenModel,
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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _capped() -> Iterator[None]:
    with memory_cap():
        yield


SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")


class _Hog(torch.autograd.Function):
    """Identity whose backward allocates ``nbytes`` for a moment (after the later layers' gradients are in)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, nbytes: int) -> Tensor:  # type: ignore[override]
        ctx.nbytes = nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        block = torch.empty(ctx.nbytes, dtype=torch.uint8, device=grad.device)
        del block
        return grad, None


class Hungry(TokenModel):
    """A piece of n samples needs n * (GPU memory / 3.5) in its forward, or inside its backward."""

    def __init__(self, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where, self.pieces = where, []  # type: ignore[var-annotated]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        n, nbytes = len(batch["x"]), len(batch["x"]) * per_sample_bytes()
        if self.where == "forward":
            block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del block
        hidden = self.net[0](batch["x"])
        if self.where == "backward":
            hidden = _Hog.apply(hidden, nbytes)
        err = (self.net[2](self.net[1](hidden)) - batch["y"]).squeeze(-1) ** 2
        self.pieces.append(n)
        return (err * batch["mask"]).sum()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_real_out_of_memory_backs_off_exactly(where: str) -> None:
    data = TokenData(48)
    model = Hungry(where, reduction="sum")
    callback = AccumulationScheduler(SCHEDULE, normalize="items", reduction="sum", count=count_tokens,
                                     microbatch_size="auto")  # fmt: skip
    with pytest.warns(UserWarning, match="continuing with micro-batches of 4 samples"):
        trainer(accelerator="gpu", devices=1, max_epochs=2, callbacks=[callback]).fit(model, loader(data, 8))
    expected, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(data, 8)] * 2)
    assert max_diff([p.double().cpu() for p in params_of(model)], expected) <= 1e-10
    assert callback._split is not None and callback._split.found == 2


@pytest.mark.parametrize("size", [3, "auto"])
def test_16_mixed_grad_scaler(size: Any) -> None:
    """Each piece's backward scaled by the GradScaler, the window unscaled once; with "auto" a real
    out-of-memory error in a forward of 8 samples first."""
    data = TokenData(48)

    class Model(Float32TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            if size == "auto":
                block = torch.empty(len(batch["x"]) * per_sample_bytes() // 2, dtype=torch.uint8, device="cuda")
                del block  # (pieces of 8 and more run out of memory)
            return super().training_step(batch, batch_idx)

    model = Model()
    callback = AccumulationScheduler(SCHEDULE, normalize="items", reduction="mean", count=count_tokens,
                                     microbatch_size=size)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(accelerator="gpu", devices=1, **precision_plugins("16-mixed"), max_epochs=2, callbacks=[callback]).fit(
            model, loader(data, 8)
        )
    expected, _ = Reference(SCHEDULE, normalize="items").run([rank_batches(data, 8)] * 2)
    wrong, _ = Reference(SCHEDULE).run([rank_batches(data, 8)] * 2)  # (the mean of token means)
    error = max_diff([p.double().cpu() for p in params_of(model)], expected)
    assert error < 1e-2 and error < 0.25 * max_diff(wrong, expected)
