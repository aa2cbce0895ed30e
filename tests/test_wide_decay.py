"""``GradientDecay`` under ``grad_accum_dtype``: a bf16 parameter's residual is kept in float32 and
``G_t = g_t + f * G_{t-1}`` (``"sum"``) or ``(1 - f) g_t + f G_{t-1}`` (``"ema"``, bias-corrected) formed
there, then rounded into ``.grad`` once. Each window's stepped gradient is checked against the float64
value formed by hand from the same bf16 micro-batch gradients: within 1.1x the error of rounding it once
(without the option the residual and the window sum are bf16, 1.8x to 2.1x here)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMixin, AccumulationScheduler, GradientDecay

K, WINDOWS, FACTOR = 8, 3, 0.9


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(K * 4 * WINDOWS, 16, generator=g), torch.randn(K * 4 * WINDOWS, 1, generator=g)


def net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def decay(mode: str) -> GradientDecay:
    return GradientDecay(FACTOR, mode=mode, bias_correction=mode == "ema")  # type: ignore[arg-type]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: list[list[Tensor]] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.seen.append([p.grad.detach().double().clone() for p in self.parameters()])  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # (the parameters stay: each window's gradient comparable)


class MixinModel(AccumulationMixin, Model):
    def __init__(self, dtype: torch.dtype | None, mode: str) -> None:
        super().__init__()
        self.configure_accumulation(K, grad_accum_dtype=dtype, log=False, reset=decay(mode))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:  # type: ignore[override]
        with self.accumulate(batch) as acc:
            acc.backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def fit(adapter: str, dtype: torch.dtype | None, mode: str) -> list[list[Tensor]]:
    x, y = data()
    if adapter == "callback":
        model: Model = Model()
        callbacks = [AccumulationScheduler(K, grad_accum_dtype=dtype, log=False), decay(mode)]
    else:
        model, callbacks = MixinModel(dtype, mode), []
    trainer = pl.Trainer(
        max_steps=WINDOWS, callbacks=callbacks, precision="bf16-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    return model.seen


def exact_windows(mode: str) -> list[list[Tensor]]:
    """Each window's decayed gradient in float64, from the bf16 model's own micro-batch gradients."""
    x, y = data()
    reference = net().to(torch.bfloat16)
    out, residual = [], None
    for w in range(WINDOWS):
        grads = []
        for j in range(w * K, (w + 1) * K):
            reference.zero_grad()
            xb, yb = x[4 * j : 4 * j + 4].bfloat16(), y[4 * j : 4 * j + 4].bfloat16()
            nn.functional.mse_loss(reference(xb), yb).backward()
            grads.append([p.grad.double() for p in reference.parameters()])  # type: ignore[union-attr]
        g = [sum(gs[i] for gs in grads) / K for i in range(len(grads[0]))]
        before = residual or [torch.zeros_like(a) for a in g]
        if mode == "ema":
            residual = [(1 - FACTOR) * a + FACTOR * b for a, b in zip(g, before, strict=True)]
            out.append([r / (1 - FACTOR ** (w + 1)) for r in residual])
        else:
            residual = [a + FACTOR * b for a, b in zip(g, before, strict=True)]
            out.append(residual)
    return out


def error(got: list[Tensor], exact: list[Tensor]) -> float:
    num = sum(float(((a - b) ** 2).sum()) for a, b in zip(got, exact, strict=True))
    return (num / sum(float((b**2).sum()) for b in exact)) ** 0.5


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
@pytest.mark.parametrize("mode", ["sum", "ema"])
def test_the_decayed_window_is_rounded_once(adapter: str, mode: str) -> None:
    exact = exact_windows(mode)
    once = [error([e.to(torch.bfloat16).double() for e in window], window) for window in exact]
    wide = fit(adapter, torch.float32, mode)
    narrow = fit(adapter, None, mode)
    for w in range(WINDOWS):
        assert error(wide[w], exact[w]) <= 1.1 * once[w], (w, error(wide[w], exact[w]) / once[w])
    # (the same run summed in bf16, residual in bf16: what the option is for)
    assert max(error(narrow[w], exact[w]) / once[w] for w in range(1, WINDOWS)) > 1.5


def test_the_residual_is_kept_and_saved_in_float32() -> None:
    x, y = data()
    policy = decay("sum")
    callbacks = [AccumulationScheduler(K, grad_accum_dtype="fp32", log=False), policy]
    trainer = pl.Trainer(
        max_steps=2, callbacks=callbacks, precision="bf16-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    saved = policy.state_dict()["residual"][0]
    assert [r.dtype for r in saved] == [torch.float32] * 4
    # after the fit the residual is back in `.grad`, in the parameters' own dtype
    assert [p.grad.dtype for p in model.parameters()] == [torch.bfloat16] * 4  # type: ignore[union-attr]
