"""The loss of the effective batch: each optimizer step logs the window's loss (the quantity whose
gradient was stepped), its gradient norm before clipping, and each task's window loss, against the
float64 reference's windows, through a CSV logger at every step."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_accum import AccumulationScheduler, Piecewise

from helpers import (
    ManualTokenModel,
    Reference,
    TokenData,
    TokenModel,
    count_tokens,
    default_dtype,
    loader,
    rank_batches,
    trainer,
)

SCHEDULE = Piecewise({0: 3, 4: 2}, unit="step")  # 13 batches per epoch: short last windows
DATA = TokenData(50)


@pytest.fixture(autouse=True)
def float64_logging() -> Iterator[None]:
    """Lightning casts what `self.log` gets to the default dtype: float64 here, to compare at 1e-12."""
    with default_dtype(torch.float64):
        yield


def logged(path: Path, name: str) -> list[float]:
    rows = list(csv.DictReader((path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    return [float(row[name]) for row in rows if row.get(name)]


def fit_logged(tmp_path: Path, model: Any, callbacks: list[Any], **kwargs: Any) -> None:
    logger = CSVLogger(tmp_path)
    t = trainer(callbacks=callbacks, max_epochs=2, logger=logger, log_every_n_steps=1, **kwargs)
    t.fit(model, loader(DATA, 4))


@pytest.mark.parametrize(("normalize", "reduction"), [("mean", None), ("items", "sum"), ("items", "mean")])
def test_callback_logs_the_window_loss_and_gradient_norm(tmp_path: Path, normalize: str, reduction: str) -> None:
    """``reduction="mean"``: ``training_step`` returns token means, weighted by their counts."""
    callback = AccumulationScheduler(SCHEDULE, normalize=normalize, count=count_tokens, reduction=reduction)
    model_reduction = "sum" if (normalize, reduction) == ("items", "sum") else "mean"
    fit_logged(tmp_path, TokenModel(reduction=model_reduction), [callback])
    reference = Reference(SCHEDULE, normalize=normalize)
    reference.run([rank_batches(DATA, 4)] * 2)
    losses, norms = logged(tmp_path, "accum/loss"), logged(tmp_path, "accum/grad_norm")
    assert len(losses) == len(reference.losses) == callback.progress.step
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) <= 1e-12
    assert max(abs(a - b) for a, b in zip(norms, reference.grad_norms, strict=True)) <= 1e-12


class StepMetrics(pl.Callback):
    """What the mixin logged at each optimizer step, from `callback_metrics` (in manual optimization
    Lightning writes rows every batch, repeating the last values)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = pl_module.accumulation_progress.step
        if step != self._step:
            self._step = step
            self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("accum/")})


@pytest.mark.parametrize("mode", ["backward", "each", "heads"])
def test_mixin_logs_the_window_and_task_losses(tmp_path: Path, mode: str) -> None:
    recorder = StepMetrics()
    fit_logged(tmp_path, ManualTokenModel(mode=mode, schedule=SCHEDULE), [recorder])
    reference = Reference(SCHEDULE)
    reference.run([rank_batches(DATA, 4)] * 2)
    assert len(recorder.rows) == len(reference.losses)
    for row, loss, norm in zip(recorder.rows, reference.losses, reference.grad_norms, strict=True):
        assert abs(row["accum/loss"] - loss) <= 1e-12 and abs(row["accum/grad_norm"] - norm) <= 1e-12
        if mode != "backward":  # the two tasks' window losses add up to the window's
            assert abs(row["accum/loss/task0"] + row["accum/loss/task1"] - loss) <= 1e-12


class NamedTasks(ManualTokenModel):
    names = ["first", "second"]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            closures = [lambda i=i: self._split_losses(self.net(batch["x"]), batch)[i] for i in (0, 1)]
            acc.backward_each(closures, names=self.names)


def test_task_names(tmp_path: Path) -> None:
    recorder = StepMetrics()
    fit_logged(tmp_path, NamedTasks(schedule=SCHEDULE), [recorder])
    assert {"accum/loss/first", "accum/loss/second", "accum/loss"} <= set(recorder.rows[-1])
    model = NamedTasks(schedule=SCHEDULE)
    model.names = ["only"]
    with pytest.raises(ValueError, match="`names` has 1 entries for 2 tasks"):
        trainer(max_epochs=1).fit(model, loader(DATA, 4))


def test_logged_at_the_loggers_cadence(tmp_path: Path) -> None:
    callback = AccumulationScheduler(SCHEDULE)
    t = trainer(callbacks=[callback], max_epochs=2, logger=CSVLogger(tmp_path), log_every_n_steps=4)
    t.fit(TokenModel(), loader(DATA, 4))
    # every 4th step (the first step's values are logged for the progress bar, not written by the logger)
    assert len(logged(tmp_path, "accum/loss")) == callback.progress.step // 4 == 3


@pytest.mark.parametrize(
    "entries",
    [
        [(2.0, 0.5), (3.0, 2.0)],  # (numbers only)
        [(torch.tensor(2.0), 0.5), (torch.tensor([3.0]), 0.5)],  # (tensors of one factor)
        [(torch.tensor(2.0), 0.5), (torch.tensor(3.0), 0.25), (1.5, 4.0)],  # (factors differ, a number beside)
        [(torch.tensor(2.0, dtype=torch.bfloat16), 3.0), (0.75, 0.5)],
    ],
)
def test_the_windows_loss_sum_is_each_loss_times_its_factor(entries: list[tuple[Any, float]]) -> None:
    """``_sum`` (the window's loss): the float64 sum of each loss times its factor, whether the losses are numbers
    or tensors, of one factor or several; against ``fractions`` (every number here is a short binary fraction)."""
    from fractions import Fraction

    from lightning_accum._core.metrics import _sum

    expected = sum(Fraction(float(v)) * Fraction(f) for v, f in entries)
    total = _sum(entries)
    assert float(total) == float(expected)
    assert not isinstance(total, torch.Tensor) or total.dtype == torch.float64
