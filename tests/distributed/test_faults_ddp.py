"""The fault suite's distributed twin: DDP on 2 gloo ranks, an exception on both ranks after a
backward pass inside a window, resumed from the checkpoint written inside that window and from
the last one at an optimizer step: both ranks bit-identical to the uninterrupted DDP run.

(Under Lightning's fork and spawn launchers the ranks run in child processes, where Lightning
calls no ``on_exception``; an ``OnExceptionCheckpoint`` there would save the launching process's
untrained model. ``docs/guide/failures.md`` says so; the single-process suite covers it.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from test_faults import Bind, Fault, Injected, ProcessedLoader

from lightning_accum import AccumulationScheduler, GradientDecay, Piecewise, Progress

from helpers import FileReport, ManualTokenModel, RankStrided, TokenData, TokenModel, trainer

pytestmark = pytest.mark.slow

WINDOWS = Piecewise({0: 3, 2: 2}, unit="step")  # per rank: windows [0-2] [3-5] [6-7] ...
DATA = TokenData(64)  # 8 batches of 4 per rank


class ShardedLoader(ProcessedLoader):
    def __init__(self) -> None:
        torch.utils.data.DataLoader.__init__(self, DATA, batch_size=4, sampler=RankStrided(len(DATA)))
        self._yielded, self._skip = 0, 0


class SaveInside(pl.Callback):
    """A checkpoint inside the window [3-5], after its second micro-batch (every rank calls it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == (0, 4):
            trainer.save_checkpoint(self.path)


def fit(kind: str, out: Path, save: Path | None = None, resume: Path | None = None) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    # "+adascale": each step's LR depends on every noise measurement so far, each rank's own
    # prefixes of the window included (held per rank in the checkpoint inside it)
    extra = {"lr_scaling": "adascale"} if kind.endswith("+adascale") else {}
    if kind.startswith("callback"):
        model: pl.LightningModule = TokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(WINDOWS, **extra), GradientDecay(0.5)]
    else:
        model, callbacks = ManualTokenModel(schedule=WINDOWS, reset=GradientDecay(0.5), **extra), []
    data = ShardedLoader()
    report = FileReport(out)
    callbacks += [Bind(data), report]
    if save is not None:
        steps = ModelCheckpoint(save, "{step}", every_n_train_steps=1, save_top_k=-1)
        callbacks += [SaveInside(save / "inside.ckpt"), steps, Fault("on_after_backward", (0, 5))]
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(
        callbacks=callbacks,
        max_epochs=2,
        devices=2,
        strategy=strategy,
        use_distributed_sampler=False,
        enable_checkpointing=save is not None,
    )
    t.fit(model, data, ckpt_path=resume)
    return report.read(world=2)


@pytest.mark.parametrize("kind", ["callback", "mixin", "callback+adascale", "mixin+adascale"])
def test_ddp_fault_resumes_bit_identically(tmp_path: Path, kind: str) -> None:
    full = fit(kind, tmp_path / "full")
    with pytest.raises(Exception, match=Injected.__name__):
        fit(kind, tmp_path / "failed", save=tmp_path / "ckpt")
    for source in ("inside.ckpt", "step=1.ckpt"):
        resumed = fit(kind, tmp_path / source, resume=tmp_path / "ckpt" / source)
        for rank in range(2):
            for got, want in zip(resumed[rank]["params"], full[rank]["params"], strict=True):
                assert torch.equal(got, want), (source, rank)


def _saved_inside(kind: str, out: Path, devices: int) -> Path:
    """A checkpoint written inside the window [3-5] of epoch 0 on ``devices`` processes."""
    if kind == "callback":
        model: pl.LightningModule = TokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(WINDOWS)]
    else:
        model, callbacks = ManualTokenModel(schedule=WINDOWS), []
    data = ShardedLoader()
    strategy: Any = DDPStrategy(start_method="fork", process_group_backend="gloo") if devices > 1 else "auto"
    t = trainer(
        callbacks=[*callbacks, Bind(data), SaveInside(out)], max_epochs=1, limit_train_batches=6, devices=devices,
        strategy=strategy, use_distributed_sampler=False,
    )  # fmt: skip
    t.fit(model, data)
    return out


@pytest.mark.parametrize("kind", ["callback", "mixin"])
def test_a_window_saved_on_one_world_size_is_refused_on_another(tmp_path: Path, kind: str) -> None:
    """Each rank's partial gradient and counts are its own until the window's end: a checkpoint written inside
    a window resumes on as many ranks as it was written on, and is refused on another number, both ways,
    naming the checkpoint and both numbers, as it loads: nothing of it is restored (the callback or the
    model could be used again, from a checkpoint or afresh)."""
    one = _saved_inside(kind, tmp_path / "one.ckpt", devices=1)
    two = _saved_inside(kind, tmp_path / "two.ckpt", devices=2)
    with pytest.raises(Exception, match=r"one.ckpt' was saved inside an accumulation window on 1 rank\(s\).*on 2"):
        fit(kind, tmp_path / "up", resume=one)
    if kind == "callback":
        model: Any = TokenModel()
        callback: Any = AccumulationScheduler(WINDOWS)
        callbacks: list[pl.Callback] = [callback]
    else:
        model, callbacks = ManualTokenModel(schedule=WINDOWS), []
    with pytest.raises(ValueError, match=r"two.ckpt' was saved inside an accumulation window on 2 rank\(s\).*on 1"):
        data = ShardedLoader()
        trainer(callbacks=[*callbacks, Bind(data)], max_epochs=1, devices=1).fit(model, data, ckpt_path=two)
    progress = callback.progress if kind == "callback" else model.accumulation_progress
    assert progress == Progress()  # (before: the checkpoint's, at step 1)
    if kind == "callback":  # validated on another number of ranks, the same checkpoint is not refused (not a fit)
        validated = AccumulationScheduler(WINDOWS)
        trainer(callbacks=[validated], devices=1).validate(_Validated(), torch.utils.data.DataLoader(DATA), two)
        assert validated.progress.step == 1


class _Validated(TokenModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.training_step(batch, batch_idx)
