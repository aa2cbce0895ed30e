"""LightningCLI: the callbacks and schedules are configurable from YAML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from helpers import KRecorder, TokenData, TokenModel, loader

pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI

from lightning_accum import AccumulationScheduler, GradientDecay, Ramp

CONFIG = """
trainer:
  max_epochs: 1
  accelerator: cpu
  devices: 1
  precision: 64-true
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_accum.AccumulationScheduler
      init_args:
        schedule:
          class_path: lightning_accum.Ramp
          init_args: {start: 1, end: 4, over: 6, unit: step}
        lr_scaling: sqrt
    - class_path: lightning_accum.GradientDecay
      init_args: {factor: 0.5, mode: ema}
    - class_path: helpers.KRecorder
"""


class Data(pl.LightningDataModule):
    def train_dataloader(self) -> Any:
        return loader(TokenData(48), 4)


def test_schedule_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    monkeypatch.setattr(sys, "argv", ["fit"])  # (not pytest's own arguments: the CLI reads `args=` only)
    cli = LightningCLI(
        TokenModel, Data, args=["fit", "--config", str(path)], save_config_callback=None, seed_everything_default=0
    )
    accumulation, decay, recorder = cli.trainer.callbacks[:3]  # type: ignore[attr-defined]
    assert isinstance(accumulation, AccumulationScheduler) and accumulation.schedule == Ramp(1, 4, over=6, unit="step")
    assert accumulation.lr_scaling == "sqrt"
    assert isinstance(decay, GradientDecay) and decay.mode == "ema"
    assert isinstance(recorder, KRecorder) and recorder.windows == [1, 1, 2, 2, 3, 3]  # 12 batches
