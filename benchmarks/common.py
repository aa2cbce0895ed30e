"""What the benchmarks share: a CPU-time timer of the training loop and a quiet one-epoch fit."""

from __future__ import annotations

import gc
import time
from typing import Any

import lightning.pytorch as pl
import torch


class LoopTimer(pl.Callback):
    """CPU seconds of the training loop only (setup excluded)."""

    def on_train_start(self, *args: Any) -> None:
        self.start = time.process_time()

    def on_train_end(self, *args: Any) -> None:
        self.seconds = time.process_time() - self.start


def timed_epoch(model: pl.LightningModule, data: Any, callbacks: list[pl.Callback], **trainer_kwargs: Any) -> float:
    """One epoch on the CPU with nothing but ``callbacks`` (no logger or progress bar unless ``trainer_kwargs`` give
    them); returns the loop's CPU seconds."""
    gc.collect()
    torch.manual_seed(0)
    timer = LoopTimer()
    options: dict[str, Any] = {"logger": False, "enable_progress_bar": False, **trainer_kwargs}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[*callbacks, timer],
        enable_checkpointing=False,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(model, data)
    return timer.seconds
