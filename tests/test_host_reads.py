"""No host read per micro-batch: on a GPU every tensor-to-Python read (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ...) stalls the CPU until the device catches up, so the next
micro-batch's kernels are not queued in time. Counted on the CPU with a ``TorchFunctionMode``
over the training loop, against Lightning's built-in accumulation of the same model (which
reads nothing): the package adds at most one per window, none per micro-batch, in every
configuration, with the loggers written at every step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_accum import AccumulationScheduler, GradientDecay, NoiseScale
from lightning_accum.progress import StepProgressBar

from helpers import HostReads, ManualTokenModel, TokenData, TokenModel, count_tokens, loader, trainer

DATA = TokenData(64, seed=3)  # 64 micro-batches of 1: 16 windows of k = 4


class CountReads(pl.Callback):
    """Counts the reads from the first training batch to the end of training."""

    def __init__(self) -> None:
        self.mode = HostReads()

    def on_train_start(self, *args: Any) -> None:
        self.mode.__enter__()

    def on_train_end(self, *args: Any) -> None:
        self.mode.__exit__(None, None, None)


def reads(tmp_path: Path, model: pl.LightningModule, callbacks: list[Any], **kwargs: Any) -> int:
    counter = CountReads()
    logger = CSVLogger(tmp_path)  # written at every step: the most a logger asks
    t = trainer(callbacks=[*callbacks, counter], max_epochs=1, logger=logger, log_every_n_steps=1, **kwargs)
    t.fit(model, loader(DATA, 1))
    return counter.mode.count


def tensor_tokens(batch: Any) -> torch.Tensor:
    return count_tokens(batch)  # a device tensor: the window's item count is read once, at its end


CALLBACKS: dict[str, Callable[[], list[Any]]] = {
    "log": lambda: [AccumulationScheduler(4)],
    "no log": lambda: [AccumulationScheduler(4, log=False)],
    "items, tensor count": lambda: [AccumulationScheduler(4, normalize="items", reduction="sum", count=tensor_tokens)],
    "items, mean": lambda: [AccumulationScheduler(4, normalize="items", count=tensor_tokens, reduction="mean")],
    "noise scale": lambda: [AccumulationScheduler(NoiseScale(4, 4))],
    "adascale": lambda: [
        AccumulationScheduler(4, normalize="items", reduction="sum", count=tensor_tokens, lr_scaling="adascale")
    ],
    "decay": lambda: [AccumulationScheduler(4), GradientDecay(0.5)],
}
MIXINS: dict[str, dict[str, Any]] = {
    "log": {},
    "no log": {"log": False},
    "items, tensor count": {"normalize": "items", "count": tensor_tokens},
    "noise scale": {"schedule": NoiseScale(4, 4)},
    "adascale": {"lr_scaling": "adascale"},
    "decay": {"reset": GradientDecay(0.5)},
    "items=, mean": {"normalize": "items", "mode": "items_arg"},
}


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> int:
    return reads(tmp_path_factory.mktemp("builtin"), TokenModel(), [], accumulate_grad_batches=4)


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_callback_reads_at_most_once_per_window(tmp_path: Path, builtin: int, name: str) -> None:
    reduction = "sum" if (name.startswith("items") and "mean" not in name) or name == "adascale" else "mean"
    added = reads(tmp_path, TokenModel(reduction=reduction), CALLBACKS[name]()) - builtin
    assert added <= 16, f"{added} host reads over 64 micro-batches in 16 windows"


@pytest.mark.parametrize("name", list(MIXINS))
def test_mixin_reads_at_most_once_per_window(tmp_path: Path, builtin: int, name: str) -> None:
    options = {"schedule": 4, **MIXINS[name]}
    reduction = "sum" if options.get("normalize") == "items" and "mode" not in options else "mean"
    added = reads(tmp_path, ManualTokenModel(reduction=reduction, **options), []) - builtin
    assert added <= 16, f"{added} host reads over 64 micro-batches in 16 windows"


# the bar counts from the window reports the accumulation reads anyway: not one read more than Lightning's own bar
@pytest.mark.parametrize("log", [True, False], ids=["log", "no log"])
def test_step_progress_bar_adds_no_host_read(tmp_path: Path, log: bool) -> None:
    def run(bar: Any, model: pl.LightningModule, accumulation: list[Any]) -> int:
        return reads(tmp_path, model, [*accumulation, bar], enable_progress_bar=True)

    own = run(pl.callbacks.TQDMProgressBar(), TokenModel(), [AccumulationScheduler(4, log=log)])
    assert run(StepProgressBar(), TokenModel(), [AccumulationScheduler(4, log=log)]) == own
    own = run(pl.callbacks.TQDMProgressBar(), ManualTokenModel(schedule=4, log=log), [])
    assert run(StepProgressBar(unit="batches"), ManualTokenModel(schedule=4, log=log), []) == own
