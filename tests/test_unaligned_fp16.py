"""16-mixed on windows that open at a batch index that is not a multiple of k.

Lightning's loop divides each loss by ``trainer.accumulate_grad_batches``, which the seam sets
to ``r + k`` for a window of ``k`` opening at batch ``r`` (``r % k != 0``). Divided by that
before backward, float16 gradients lose (r + k) / k of the GradScaler's headroom and small
entries flush to zero. Every loss must reach backward divided by k at most, so that unaligned
windows are as precise as aligned ones. Measured here: the stepped gradient of each window
against the float64 gradient of the same window at the same parameters.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import Float32TokenModel, TokenData, loader, make_net, token_losses, trainer

# 3 per window (aligned) for 41 windows = 123 batches, then 4 from batch 123 on: 123 % 4 == 3, so every
# later window is unaligned, with Lightning's divisor growing from 127 to the epoch's length
SCHEDULE = Piecewise({0: 3, 41: 4}, unit="step")
DATA = TokenData(400)  # 200 batches of 2
TINY = 1e-5  # small losses: the float16 gradients live near the bottom of their range, where division hurts


class TinyLoss(Float32TokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * TINY


class GradientProbe(pl.Callback):
    """After the package's rescale: the stepped gradient, the parameters it applies to, the window's batches."""

    def __init__(self) -> None:
        self.windows: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = []
        self._batches: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batches.append(batch_idx)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        params = [p.detach().double().clone() for p in pl_module.parameters()]
        grads = [p.grad.detach().double().clone() for p in pl_module.parameters()]
        self.windows.append((self._batches, params, grads))
        self._batches = []


def reference_gradient(params: list[torch.Tensor], batches: list[int]) -> list[torch.Tensor]:
    net = make_net()
    with torch.no_grad():
        for p, value in zip(net.parameters(), params, strict=True):
            p.copy_(value)
    loss = sum(
        token_losses(net, DATA.batch(slice(2 * i, 2 * i + 2)))[0] / DATA.mask[2 * i : 2 * i + 2].sum() for i in batches
    )
    (loss * TINY / len(batches)).backward()  # type: ignore[union-attr]
    return [p.grad for p in net.parameters()]  # type: ignore[misc]


def relative_error(grads: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - e).flatten() for g, e in zip(grads, expected, strict=True)]).norm()
    return float(diff / torch.cat([e.flatten() for e in expected]).norm())


def test_unaligned_windows_as_precise_as_aligned() -> None:
    probe = GradientProbe()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**6))
    t = trainer(precision=None, plugins=[plugin], max_epochs=1, callbacks=[AccumulationScheduler(SCHEDULE), probe])
    t.fit(TinyLoss(lr=0.01, optimizer="plain-sgd"), loader(DATA, 2))
    aligned, unaligned = [], []
    for batches, params, grads in probe.windows:
        error = relative_error(grads, reference_gradient(params, batches))
        (aligned if batches[0] < 123 else unaligned).append(error)
    assert len(aligned) == 41 and len(unaligned) == 20  # 19 windows of 4, then one of 1 at the epoch's end
    assert max(unaligned) <= 2 * max(aligned), (max(aligned), max(unaligned))
    print(f"relative gradient error, aligned {max(aligned):.2e}, unaligned {max(unaligned):.2e}")
