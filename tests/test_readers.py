"""Who reads the window numbers, and what each is given after every window (``reporting.Readers``), seen in
real fits from inside the callback (a subclass's ``on_train_batch_end``, after the callback's own: the
callback is no reader of its own numbers): a monitor gets the keys it names, the progress bar ``k`` and the
loss, a batch reader or an ``on_window_end`` hook every key; every key is published at the loggers' steps
and in each epoch's last window; a number that does not change keeps its tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_accum import AccumulationScheduler

from helpers import TokenData, TokenModel, loader, trainer

DATA = TokenData(48, seed=5)  # 12 batches of 4 an epoch: 3 windows of k = 4
KEYS = {"accum/k", "accum/loss", "accum/lr", "accum/effective_batch", "accum/samples", "accum/items"}


class Seen(AccumulationScheduler):
    """The callback, recording what ``callback_metrics`` and the progress bar hold after each window."""

    def __init__(self) -> None:
        super().__init__(4)
        self.metrics: list[dict[str, Any]] = []
        self.bar: list[dict[str, float]] = []
        self.seen_lrs: list[float] = []  # `accum/lr` as it was when published
        self.at_train_start: list[set[str]] = []  # the `accum/` keys in `callback_metrics` when a fit starts

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.at_train_start.append({k for k in trainer.callback_metrics if k.startswith("accum/")})

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        if len(self.metrics) < trainer.global_step:
            accum = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("accum/")}
            self.metrics.append(accum)
            self.bar.append({k: v for k, v in trainer.progress_bar_metrics.items() if k.startswith("accum/")})
            if "accum/lr" in accum:
                self.seen_lrs.append(float(accum["accum/lr"]))


class Monitor(pl.Callback):
    def __init__(self, key: str) -> None:
        self.monitor = key


class BatchReader(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None: ...


class Hook(pl.Callback):
    def on_window_end(self, *args: Any) -> None: ...


def seen(epochs: int = 2, **options: Any) -> Seen:
    callback = Seen()
    t = trainer(callbacks=[callback, *options.pop("callbacks", [])], max_epochs=epochs, **options)
    t.fit(TokenModel(), loader(DATA, 4))
    assert len(callback.metrics) == t.global_step == 3 * epochs
    return callback


def test_a_monitor_gets_its_keys_every_window_and_every_key_at_the_epochs_end() -> None:
    callback = seen(callbacks=[Monitor("accum/loss")])
    losses = [float(m["accum/loss"]) for m in callback.metrics]
    assert len(set(losses)) == 6  # a fresh loss after every window
    assert [set(m) for m in callback.metrics[:2]] == [{"accum/loss"}] * 2  # (nothing else read in the middle)
    assert set(callback.metrics[2]) >= KEYS  # the epoch's last window: every key
    samples = [float(m["accum/samples"]) for m in callback.metrics[2:]]
    assert samples == [48.0, 48.0, 48.0, 96.0]  # kept between the epochs' ends


def test_a_checkpoint_filename_is_a_monitor_of_the_keys_it_names(tmp_path: Path) -> None:
    every = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{accum/samples:.0f}", every_n_train_steps=1,
                            save_top_k=-1)  # fmt: skip
    callback = seen(epochs=1, callbacks=[every], enable_checkpointing=True)
    assert [float(m["accum/samples"]) for m in callback.metrics] == [16.0, 32.0, 48.0]


def test_the_progress_bar_gets_k_and_the_loss_every_window() -> None:
    callback = seen(callbacks=[ProgressBar()], enable_progress_bar=True)
    assert [set(b) for b in callback.bar] == [{"accum/k", "accum/loss"}] * 6
    assert len({b["accum/loss"] for b in callback.bar}) == 6
    assert [set(m) for m in callback.metrics[:2]] == [set()] * 2  # `callback_metrics`: every key at the epoch's end
    assert set(callback.metrics[2]) >= KEYS


def test_the_loggers_get_every_key_at_their_steps(tmp_path: Path) -> None:
    callback = seen(epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    assert [set(m) >= KEYS | {"accum/grad_norm"} for m in callback.metrics] == [False, True, True]


@pytest.mark.parametrize("reader", [BatchReader, Hook])
def test_a_batch_reader_or_a_hook_gets_every_key_every_window(reader: type[pl.Callback]) -> None:
    callback = seen(callbacks=[reader()])
    assert all(set(m) >= KEYS for m in callback.metrics)
    assert len({float(m["accum/samples"]) for m in callback.metrics}) == 6
    assert ("accum/grad_norm" in callback.metrics[0]) == (reader is Hook)  # the norm: where it is asked for


def test_a_number_that_does_not_change_keeps_its_tensor() -> None:
    metrics = seen(callbacks=[BatchReader()]).metrics
    k, samples = [m["accum/k"] for m in metrics], [m["accum/samples"] for m in metrics]
    assert all(t is k[0] for t in k)  # k = 4 throughout: one tensor
    assert len({id(t) for t in samples}) == 6  # a new tensor for each new number
    assert metrics[0]["accum/samples"] is metrics[0]["accum/items"]  # equal numbers of one window share one


def test_a_tensor_learning_rate_is_the_rate_each_step_used_and_stays_so() -> None:
    class TensorLR(TokenModel):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=torch.tensor(0.1), foreach=False)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    callback = Seen()
    trainer(callbacks=[callback, BatchReader()], max_epochs=1).fit(TensorLR(), loader(DATA, 4))
    lrs = [m["accum/lr"] for m in callback.metrics]
    assert callback.seen_lrs == pytest.approx([0.1, 0.05, 0.025])  # the rate each step used, as published
    assert [float(t) for t in lrs] == callback.seen_lrs  # ... and after the fit (a scheduler steps it in place)


def test_a_new_fit_without_a_checkpoint_shows_none_of_an_earlier_fits_numbers() -> None:
    callback = Seen()
    trainer(callbacks=[callback, Monitor("accum/loss")], max_epochs=1).fit(TokenModel(), loader(DATA, 4))
    trainer(callbacks=[callback, Monitor("accum/loss")], max_epochs=1).fit(TokenModel(), loader(DATA, 4))
    assert callback.at_train_start == [set(), set()]  # (a new Trainer: nothing of the first fit's)


def test_a_fit_stopped_after_a_window_publishes_it_whole(tmp_path: Path) -> None:
    class StopAfter(pl.Callback):  # (no batch hook of its own: no reader)
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:  # (the second window's step)
                trainer.should_stop = True

    callback = Seen()
    t = trainer(callbacks=[callback, ProgressBar(), StopAfter()], enable_progress_bar=True, max_epochs=1)
    t.fit(TokenModel(), loader(DATA, 4))
    assert t.global_step == 2
    metrics = t.callback_metrics
    assert set(metrics) >= KEYS and float(metrics["accum/samples"]) == 32.0  # the second window, the fit's last
    assert float(metrics["accum/loss"]) == float(torch.tensor(callback.bar[-1]["accum/loss"], dtype=torch.float32))


def test_a_batch_reader_before_the_callback_is_warned_about() -> None:
    with pytest.warns(UserWarning, match="BatchReader come.s. before AccumulationScheduler"):
        trainer(callbacks=[BatchReader(), Seen()], max_epochs=1).fit(TokenModel(), loader(DATA, 4))


def test_a_lambda_callbacks_batch_hook_is_a_reader() -> None:
    callback = seen(callbacks=[LambdaCallback(on_train_batch_end=lambda *args: None)])
    assert all(set(m) >= KEYS for m in callback.metrics)


def test_a_callback_fit_again_by_a_new_trainer_logs_at_its_steps(tmp_path: Path) -> None:
    callback, rows = AccumulationScheduler(4), []
    for fit_ in range(2):
        logger = CSVLogger(tmp_path, name=str(fit_))
        t = trainer(callbacks=[callback], max_epochs=1, logger=logger, log_every_n_steps=2)
        t.fit(TokenModel(), loader(DATA, 4))
        lines = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
        header = lines[0].split(",")
        rows.append([line.split(",")[header.index("step")] for line in lines[1:]
                     if line.split(",")[header.index("accum/loss")]])  # fmt: skip
    assert rows[1] == rows[0] == ["1"]  # the second window, Lightning's logging step (not the callback's 4th and 6th)
