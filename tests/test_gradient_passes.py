"""Passes over the gradient the callback makes per window, counted (not timed) with a
``TorchDispatchMode`` around its hooks: an operator on the gradient's storage is a pass over (part of)
it. Lightning's built-in accumulation makes none (its division is on the loss); the callback makes only
what the maths or a reader asks for: nothing for ``normalize="mean"`` where the gradient's norm is not
read, one fused norm where it is (a logger's step, an ``on_window_end`` hook, a monitor naming it), one
fused rescale for ``"items"`` (its divisor, the global item count, is known only at the window's end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_accum import AccumulationScheduler

from helpers import TokenData, TokenModel, count_tokens, loader, trainer

DATA = TokenData(64, seed=3)  # 16 batches of 4 a epoch: 4 windows of k = 4


class GradientOps(TorchDispatchMode):
    """Counts operators whose tensors share storage with a parameter's gradient (entered in the callback's hooks)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params, self.count = params, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        grads = {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
        tensors = [a for a in (*args, *(kwargs or {}).values()) for a in (a if isinstance(a, list | tuple) else [a])]
        self.count += any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in grads for t in tensors)
        return func(*args, **(kwargs or {}))


class Counted(AccumulationScheduler):
    """The callback with its own hooks' operators on the gradient counted."""

    ops = 0

    def _counted(self, hook: Any, trainer: pl.Trainer, *args: Any) -> Any:
        with GradientOps(list(trainer.lightning_module.parameters())) as mode:
            result = hook(trainer, *args)
        Counted.ops += mode.count
        return result

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counted(super().on_before_backward, trainer, *args)

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counted(super().on_after_backward, trainer, *args)

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counted(super().on_before_optimizer_step, trainer, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counted(super().on_train_batch_end, trainer, *args)


class Hook(pl.Callback):
    def on_window_end(self, *args: Any) -> None: ...


class BatchReader(pl.Callback):
    """A user's callback that may read ``trainer.callback_metrics`` after any batch: given every number every
    window but the gradient's norm, measured where it is asked for."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.callback_metrics.get("accum/k") is not None and len(self.losses) < trainer.global_step:
            self.losses.append(float(trainer.callback_metrics["accum/loss"]))
            if "accum/grad_norm" in trainer.callback_metrics:
                self.norms.append(float(trainer.callback_metrics["accum/grad_norm"]))


class NormMonitor(pl.Callback):
    monitor = "accum/grad_norm"


@pytest.mark.parametrize(
    ("normalize", "log", "reader", "per_window"),
    [
        ("mean", False, None, 0),  # nothing to do: each loss was divided by k
        ("mean", True, None, 0),  # nobody reads the norm (no logger, no bar, no hook)
        ("mean", True, "bar", 0),  # the progress bar shows k and the loss, not the norm
        ("mean", True, "logger", 1),  # the loggers write the norm at every step: one fused norm
        ("mean", True, "hook", 1),  # an `on_window_end` hook is handed the whole report
        ("mean", True, "batch reader", 0),  # a user's `on_train_batch_end`: every number but the norm
        ("mean", True, "norm monitor", 1),  # a monitor of `accum/grad_norm`
        ("items", False, None, 1),  # the rescale by the global item count
        ("items", True, "logger", 2),  # the rescale and the norm
    ],
)
def test_passes_over_the_gradient_per_window(
    tmp_path: Path, normalize: str, log: bool, reader: str | None, per_window: int
) -> None:
    Counted.ops = 0
    items = {"normalize": "items", "count": count_tokens, "reduction": "sum"} if normalize == "items" else {}
    callbacks: list[pl.Callback] = [Counted(4, log=log, **items)]  # type: ignore[arg-type]
    options: dict[str, Any] = {}
    if reader == "logger":
        options = {"logger": CSVLogger(tmp_path), "log_every_n_steps": 1}
    elif reader == "bar":
        options = {"enable_progress_bar": True}
    elif reader == "hook":
        callbacks.append(Hook())
    elif reader == "batch reader":
        callbacks.append(BatchReader())
    elif reader == "norm monitor":
        callbacks.extend([BatchReader(), NormMonitor()])
    t = trainer(callbacks=callbacks, max_epochs=1, **options)
    t.fit(TokenModel(reduction="sum" if normalize == "items" else "mean"), loader(DATA, 4))
    assert t.global_step == 4
    assert Counted.ops == per_window * t.global_step
    if reader in ("batch reader", "norm monitor"):
        assert len(set(callbacks[1].losses)) == t.global_step  # a fresh loss at every step
        assert len(set(callbacks[1].norms)) == (t.global_step if reader == "norm monitor" else 0)
