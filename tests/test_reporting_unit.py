"""Table tests of the window's numbers: ``_core/metrics.py`` (the window's losses) and ``_trainer/reporting.py``
(who reads them, ``WindowReport``, where they are published), each against hand-computed values, with fakes for the
trainer (no fit)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_accum._core.engine import Closing
from lightning_accum._core.metrics import WindowMetrics, weigh, weighted, window_losses
from lightning_accum._trainer.reporting import (
    NOTHING,
    Readers,
    Reported,
    Wants,
    WindowReport,
    announce,
    empty,
    listeners,
    lr_names,
    metric_values,
    readers_before,
    reads_counts_only,
    report,
    show,
)
from lightning_accum.schedules import Progress

# --------------------------------------------------------------------------------------------- _core/metrics.py


@pytest.mark.parametrize(
    ("loss", "items", "expected"),
    [
        (2.0, 3, 6.0),
        (2.0, 2.5, 5.0),
        (float("nan"), 0, 0.0),
        (float("nan"), 0.0, 0.0),
        (2.0, torch.tensor(3), 6.0),
        (float("nan"), torch.tensor(0), 0.0),
        (2.0, torch.tensor(0), 0.0),
        (-1.5, 1, -1.5),
    ],
)
def test_weigh_is_the_loss_times_its_items_and_0_without_items(loss: float, items: Any, expected: float) -> None:
    assert weigh(torch.tensor(loss), items).item() == expected


def test_weigh_with_no_items_adds_no_gradient() -> None:
    for items in (0, torch.tensor(0)):
        x = torch.tensor(float("nan"), requires_grad=True)  # a NaN loss, as a mean over no tokens
        out = weigh(x, items)
        out.backward()
        assert out.item() == 0.0 and x.grad is not None and x.grad.item() == 0.0


@pytest.mark.parametrize(
    ("sums", "count", "expected"),
    [
        ({"loss": 6.0, "loss/a": 1.5}, 3, {"loss": 2.0, "loss/a": 0.5}),
        ({"loss": 5.0}, 1, {"loss": 5.0}),
        ({"loss": 0.0}, 0, None),
        ({"loss": 7.0}, 0, None),
        ({}, 2, {}),
        ({"loss": -3.0}, 4, {"loss": -0.75}),
    ],
)
def test_window_losses_are_the_sums_over_the_count(sums: dict[str, float], count: int, expected: Any) -> None:
    assert window_losses(sums, count) == expected


def test_weighted_table() -> None:
    loss = torch.tensor(2.0)
    same, nothing = weighted(loss, None)
    assert same is loss and nothing is False
    six, nothing = weighted(loss, 3)
    assert six.item() == 6.0 and not nothing
    zero, nothing = weighted(torch.tensor(float("nan")), 0)
    assert zero.item() == 0.0 and nothing
    zero, nothing = weighted(torch.tensor(float("nan")), torch.tensor(0))
    assert zero.item() == 0.0 and bool(nothing)
    four, nothing = weighted(loss, torch.tensor(2))
    assert four.item() == 4.0 and not bool(nothing)


def _metrics(*losses: tuple[str, float, float]) -> WindowMetrics:
    metrics = WindowMetrics()
    metrics.tracking = True
    for name, value, factor in losses:
        metrics.add_loss(torch.tensor(value), name, factor)
        metrics.commit()
    return metrics


def test_window_metrics_keep_nothing_unless_tracking() -> None:
    metrics = WindowMetrics()
    metrics.add_loss(torch.tensor(1.0))
    metrics.add_grad_norm([torch.tensor([3.0, 4.0])])
    metrics.commit()
    assert metrics.names() == [] and metrics.sums() == [] and metrics.grad_norm_on_device() is None
    assert metrics.read() == ({}, [])


def test_window_metrics_names_are_sorted_and_sums_are_each_loss_times_its_factor() -> None:
    metrics = _metrics(("z", 1.0, 1.0), ("loss", 3.0, 1.0), ("a", 2.0, 0.5), ("loss", 2.5, 2.0), ("z", 4.0, 1.0))
    assert metrics.names() == ["a", "loss", "z"]
    sums = metrics.sums()
    assert [float(s) for s in sums] == [1.0, 8.0, 5.0]
    assert all(isinstance(s, torch.Tensor) and s.dtype == torch.float64 for s in sums)
    two = _metrics(("loss", 1.0, 1.0), ("b", 2.0, 1.0))  # (two names: sorted too)
    assert two.names() == ["b", "loss"] and [float(s) for s in two.sums()] == [2.0, 1.0]
    assert _metrics(("task", 1.0, 1.0)).names() == ["task"]


def test_window_metrics_sum_in_float64() -> None:
    value = torch.tensor(0.1, dtype=torch.float32)
    metrics = WindowMetrics()
    metrics.tracking = True
    for _ in range(3):
        metrics.add_loss(value, factor=3.0)
        metrics.commit()
    x = float(value)  # the float32 number, exactly, in float64
    (total,) = metrics.sums()
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float64
    assert float(total) == (x + x + x) * 3.0
    metrics.add_loss(torch.tensor([0.25]), factor=1.0)  # (a shape-(1,) loss, and a second factor)
    metrics.commit()
    (total,) = metrics.sums()
    assert float(total) == pytest.approx(x * 9 + 0.25, rel=1e-15)


def test_the_micro_batch_under_way_is_not_the_windows_until_committed() -> None:
    metrics = _metrics(("loss", 1.0, 1.0), ("b", 10.0, 1.0))
    metrics.add_loss(torch.tensor(100.0))
    metrics.add_loss(torch.tensor(200.0), "c")
    assert metrics.names() == ["b", "loss"]
    assert [float(s) for s in metrics.sums()] == [10.0, 1.0]
    assert metrics.read()[0] == {"b": 10.0, "loss": 1.0}
    metrics.drop()
    metrics.add_loss(torch.tensor(2.0))
    metrics.commit()
    assert metrics.names() == ["b", "loss"] and [float(s) for s in metrics.sums()] == [10.0, 3.0]
    metrics.drop()  # (nothing under way: nothing taken back)
    assert [float(s) for s in metrics.sums()] == [10.0, 3.0]
    metrics.clear()
    assert metrics.names() == [] and metrics.sums() == []
    metrics.add_loss(torch.tensor(4.0))  # (under way in a cleared window: not the window's yet)
    assert metrics.names() == [] and metrics.read() == ({}, [])
    fresh = WindowMetrics()
    fresh.tracking = True
    fresh.add_loss(torch.tensor(4.0))
    fresh.add_loss(torch.tensor(5.0), "task")
    assert fresh.names() == [] and fresh.sums() == []
    fresh.drop()
    fresh.commit()
    assert fresh.names() == []


def test_parts_and_read_give_each_sum_as_factor_times_parts_plus_offset() -> None:
    metrics = WindowMetrics()
    metrics.load_sums(["loss", "x"], [1.5, 0.25])  # (a checkpoint's sums: numbers)
    metrics.tracking = True
    a, b = torch.tensor(2.0), torch.tensor(3.0)
    for value, name, factor in [(a, "loss", 2.0), (b, "loss", 2.0), (a, "y", 1.0), (a, "z", 2.0), (b, "z", 3.0)]:
        metrics.add_loss(value, name, factor)
        metrics.commit()
    parts = metrics.parts()
    assert [(name, factor, offset) for name, _, factor, offset in parts] == [
        ("loss", 2.0, 1.5),
        ("x", 1.0, 0.25),
        ("y", 1.0, 0.0),
        ("z", 1.0, 0.0),
    ]
    assert (
        [float(p) for p in parts[0][1]] == [2.0, 3.0] and parts[1][1] == [] and [float(p) for p in parts[2][1]] == [2.0]
    )
    assert [float(p) for p in parts[3][1]] == [13.0]  # (mixed factors: summed on the device)
    sums, extra = metrics.read([torch.tensor(5.0), torch.tensor(7.0)])
    assert sums == {"loss": 11.5, "x": 0.25, "y": 2.0, "z": 13.0} and extra == [5.0, 7.0]
    assert [float(s) for s in metrics.sums()] == [11.5, 0.25, 2.0, 13.0]


def test_read_sums_exactly() -> None:
    big = torch.tensor(1e16, dtype=torch.float64)
    metrics = _metrics()
    for value in (big, torch.tensor(1.0, dtype=torch.float64), -big):
        metrics.add_loss(value)
        metrics.commit()
    assert metrics.read()[0] == {"loss": 1.0}


def test_load_sums_puts_back_a_checkpoints_sums() -> None:
    metrics = _metrics(("old", 9.0, 1.0))
    metrics.add_grad_norm([torch.tensor([3.0, 4.0])])
    metrics.load_sums(["b", "a"], [2, 0.5])
    assert metrics.names() == ["a", "b"] and metrics.sums() == [0.5, 2.0] and metrics.grad_norm_on_device() is None
    metrics.drop()  # (the loaded sums are committed)
    assert metrics.sums() == [0.5, 2.0]
    metrics.tracking = True
    metrics.add_loss(torch.tensor(1.0), "a", 4.0)
    metrics.commit()
    assert [float(s) for s in metrics.sums()] == [4.5, 2.0]
    with pytest.raises(ValueError, match="1 loss names for 2 sums"):
        WindowMetrics().load_sums(["loss"], [1.0, 2.0])
    with pytest.raises(ValueError, match="2 loss names for 1 sums"):
        WindowMetrics().load_sums(["a", "b"], [1.0])


def test_the_gradient_norm_adds_each_measures_square() -> None:
    metrics = WindowMetrics()
    metrics.tracking = True
    assert metrics.grad_norm_on_device() is None
    metrics.add_grad_norm([torch.tensor([3.0, 4.0])])
    norm = metrics.grad_norm_on_device()
    assert norm is not None and norm.item() == 5.0
    metrics.add_grad_norm([torch.tensor([12.0]), torch.tensor([[0.0]])])
    norm = metrics.grad_norm_on_device()
    assert norm is not None and norm.item() == 13.0
    metrics.clear()
    assert metrics.grad_norm_on_device() is None


# ----------------------------------------------------------------------------------------- _trainer/reporting.py


def _window(**changes: Any) -> WindowReport:
    fields: dict[str, Any] = dict(
        step=4, epoch=1, k=3, microbatches=3, samples=12, items=30, loss=0.5,
        progress=Progress(epoch=1, step=4, samples=40, items=100),
    )  # fmt: skip
    fields.update(changes)
    return WindowReport(**fields)


def test_window_report_defaults() -> None:
    window = _window()
    assert dict(window.task_losses) == {} and dict(window.lr) == {} and window.optimizers == (0,)
    assert window.grad_norm is None and window.noise_scale is None
    assert window.microbatch_size is None and window.seconds is None
    assert window.task_losses is empty() and len(empty()) == 0
    with pytest.raises(TypeError):
        empty()["x"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):  # (a hook cannot change what the next one is handed)
        window.k = 1  # type: ignore[misc]


def test_metric_values_table() -> None:
    assert metric_values(_window(loss=None)) == {"k": 3, "effective_batch": 12, "samples": 40, "items": 100}
    assert metric_values(_window(seconds=0.0)) == {
        "k": 3,
        "loss": 0.5,
        "effective_batch": 12,
        "samples": 40,
        "items": 100,
    }
    full = _window(
        task_losses={"loss/a": 0.25}, grad_norm=2.0, lr={"lr": 0.1}, noise_scale=0.0, microbatch_size=0, seconds=4.0
    )
    assert metric_values(full) == {
        "k": 3, "loss": 0.5, "loss/a": 0.25, "grad_norm": 2.0, "lr": 0.1, "effective_batch": 12, "samples": 40,
        "items": 100, "noise_scale": 0.0, "microbatch_size": 0, "samples_per_second": 3.0, "tokens_per_second": 7.5,
    }  # fmt: skip
    assert metric_values(_window(loss=0.0, grad_norm=0.0))["loss"] == 0.0
    assert metric_values(_window(grad_norm=0.0))["grad_norm"] == 0.0


def _optimizer(kind: type = torch.optim.SGD, groups: int = 1, **group: Any) -> Any:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))], **group} for _ in range(groups)]
    return kind(params, lr=0.1)


def test_lr_names_as_learning_rate_monitor_names_them() -> None:
    sgd, sgd2, sgd3, adam = _optimizer(), _optimizer(), _optimizer(), _optimizer(torch.optim.Adam)
    assert lr_names([sgd], [(sgd, [0.1])]) == {"lr": 0.1}
    two_groups = _optimizer(groups=2)
    assert lr_names([two_groups], [(two_groups, [0.1, 0.2])]) == {"lr-SGD/pg1": 0.1, "lr-SGD/pg2": 0.2}
    named = _optimizer(groups=2, name="head")
    assert lr_names([named], [(named, [0.1, 0.2])]) == {"lr-SGD/head": 0.2}  # (as named: the last wins)
    assert lr_names([sgd, adam], [(sgd, [0.1])]) == {"lr-SGD": 0.1}
    assert lr_names([sgd, adam], [(sgd, [0.1]), (adam, [0.3])]) == {"lr-SGD": 0.1, "lr-Adam": 0.3}
    assert lr_names([sgd, sgd2, sgd3], [(sgd, [1]), (sgd2, [2]), (sgd3, [3])]) == {
        "lr-SGD": 1, "lr-SGD-1": 2, "lr-SGD-2": 3,
    }  # fmt: skip
    assert lr_names([adam, sgd, sgd2], [(sgd2, [2]), (adam, [3])]) == {"lr-SGD-1": 2, "lr-Adam": 3}
    wrapped = SimpleNamespace(optimizer=sgd2)  # (a LightningOptimizer)
    assert lr_names([sgd, wrapped], [(wrapped, [2])]) == {"lr-SGD-1": 2}
    assert lr_names([sgd, adam], [(sgd3, [5])]) == {"lr-SGD": 5}  # (not among them: its type's name)
    with pytest.raises(ValueError):
        lr_names([sgd, adam], [(two_groups, [0.1])])


def test_lr_names_put_the_optimizers_with_schedulers_first() -> None:
    sgd, sgd2, adam = _optimizer(), _optimizer(), _optimizer(torch.optim.Adam)

    def config(optimizer: Any, name: str | None = None) -> Any:
        return SimpleNamespace(scheduler=SimpleNamespace(optimizer=optimizer), name=name)

    used = [(sgd, [1]), (sgd2, [2])]
    assert lr_names([sgd, sgd2], used, [config(sgd2)]) == {"lr-SGD-1": 1, "lr-SGD": 2}
    assert lr_names([sgd, sgd2], used, [config(sgd)]) == {"lr-SGD": 1, "lr-SGD-1": 2}
    assert lr_names([sgd, sgd2], used, [config(sgd2, "mine")]) == {"lr-SGD": 1, "mine": 2}
    assert lr_names([sgd, adam], [(sgd, [1]), (adam, [3])], [config(adam, "a")]) == {"lr-SGD": 1, "a": 3}
    assert lr_names([sgd], [(sgd, [1])], [config(sgd, "one")]) == {"lr": 1}


def _hook(trainer: Any, pl_module: Any, window: Any) -> None:
    pass


counts_only = reads_counts_only(lambda trainer, pl_module, window: None)


# (readers, step, last) -> Wants, worked out by hand from `Readers`' docstring
_A = dict(log=True, loggers=True, every=50, bar=True, hooks=[], watched={"accum/loss", "val_loss"})
_B = dict(log=True, loggers=True, every=50, bar=True, hooks=[], watched=())
_LOSS = frozenset({"accum/loss"})
_NONE: frozenset[str] = frozenset()


@pytest.mark.parametrize(
    ("readers", "step", "last", "expected"),
    [
        (_A, 3, False, Wants(True, False, True, False, False, True, _LOSS)),
        (_A, 50, False, Wants(True, True, True, True, False, False, None)),
        (_A, 100, False, Wants(True, True, True, True, False, False, None)),
        (_A, 51, False, Wants(True, False, True, False, False, True, _LOSS)),
        (_A, 3, True, Wants(True, False, True, False, False, False, None)),
        (_A, 50, True, Wants(True, True, True, True, False, False, None)),
        (_B, 3, False, Wants(False, False, True, False, False, True, _NONE)),
        (_B, 3, True, Wants(True, False, True, False, False, False, None)),
        ({**_B, "bar": False}, 3, False, NOTHING),
        ({**_B, "bar": False}, 50, False, Wants(True, True, True, True, False, False, None)),
        ({**_B, "bar": False, "loggers": False}, 50, False, NOTHING),
        ({**_B, "bar": False, "loggers": False}, 50, True, Wants(True, False, True, False, False, False, None)),
        ({**_B, "every": 0}, 5, False, Wants(False, False, True, False, False, True, _NONE)),
        ({**_B, "every": 1}, 7, False, Wants(True, True, True, True, False, False, None)),
        ({**_B, "watched": {"accum/grad_norm"}}, 3, False,
         Wants(True, False, True, True, False, True, frozenset({"accum/grad_norm"}))),
        ({**_B, "hooks": [_hook]}, 3, False, Wants(True, False, True, True, True, False, None)),
        ({**_B, "hooks": [counts_only]}, 3, False, Wants(False, False, True, False, True, True, _NONE)),
        ({**_B, "hooks": [counts_only], "bar": False}, 3, False, Wants(False, False, True, False, True, False, _NONE)),
        ({**_B, "unknown": True}, 3, False, Wants(True, False, True, False, False, False, None)),
        ({**_B, "unknown": True}, 50, False, Wants(True, True, True, True, False, False, None)),
        ({**_A, "log": False}, 3, False, NOTHING),
        ({**_A, "log": False}, 50, False, NOTHING),
        ({**_A, "log": False}, 50, True, NOTHING),
        ({**_A, "log": False, "unknown": True}, 3, False, NOTHING),
        ({**_A, "log": False, "hooks": [_hook]}, 50, False, Wants(False, False, True, True, True, False, None)),
        ({**_A, "log": False, "hooks": [counts_only]}, 3, True, Wants(False, False, True, False, True, False, None)),
    ],
)  # fmt: skip
def test_what_a_window_computes_and_where_it_goes(
    readers: dict[str, Any], step: int, last: bool, expected: Wants
) -> None:
    assert Readers(**readers).wants(step, last) == expected


@pytest.mark.parametrize(
    ("readers", "any_", "any_key", "asks_last"),
    [
        (_A, True, False, True),
        ({**_B, "loggers": False}, True, False, True),  # (the bar)
        ({**_B, "loggers": False, "bar": False}, False, False, True),
        ({**_B, "loggers": False, "bar": False, "watched": {"accum/k"}}, True, False, True),
        ({**_B, "loggers": False, "bar": False, "watched": {"val_loss"}}, False, False, True),
        ({**_B, "loggers": False, "bar": False, "hooks": [counts_only]}, False, False, True),
        ({**_B, "loggers": False, "bar": False, "hooks": [_hook]}, True, True, False),
        ({**_B, "loggers": False, "bar": False, "unknown": True}, True, True, False),
        ({**_A, "log": False}, False, False, False),
        ({**_A, "log": False, "unknown": True}, False, False, False),
        ({**_A, "log": False, "hooks": [_hook]}, True, True, False),
        ({**_A, "log": False, "hooks": [counts_only]}, False, False, False),
    ],
)
def test_whether_anyone_reads_a_windows_numbers(
    readers: dict[str, Any], any_: bool, any_key: bool, asks_last: bool
) -> None:
    found = Readers(**readers)
    assert (found.any, found.any_key, found.asks_last) == (any_, any_key, asks_last)
    assert found.loggers == (readers["log"] and readers["loggers"]) and found.bar == (readers["log"] and readers["bar"])


def test_nothing_is_wanted_by_default() -> None:
    assert tuple(NOTHING) == (False, False, False, False, False, False, None)
    assert Wants(True, True, True, True, True) == (True, True, True, True, True, False, None)


def test_of_nobody_reads_nothing() -> None:
    nobody = Readers.of_nobody()
    assert (nobody.any, nobody.any_key, nobody.loggers, nobody.bar) == (False, False, False, False)
    assert nobody.wants(1) is NOTHING and nobody.wants(1, last=True) is NOTHING


class _Reader(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        pass


class _StartReader(pl.Callback):
    def on_train_batch_start(self, *args: Any) -> None:
        pass


class _Quiet(pl.Callback):
    def on_train_epoch_end(self, *args: Any) -> None:
        pass


class _Monitor(pl.Callback):
    def __init__(self, monitor: Any = None, filename: Any = None) -> None:
        self.monitor, self.filename = monitor, filename


def _trainer(callbacks: list[Any], module: Any = None, **more: Any) -> Any:
    connector = SimpleNamespace(_progress_bar_metrics={}, _callback_metrics={}, _logged_metrics={})
    fields: dict[str, Any] = dict(
        callbacks=callbacks, lr_scheduler_configs=[], progress_bar_callback=None, loggers=[], log_every_n_steps=50,
        lightning_module=module if module is not None else pl.LightningModule(), _logger_connector=connector,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=17)),
    )  # fmt: skip
    fields.update(more)
    return SimpleNamespace(**fields)


def test_readers_of_a_trainer() -> None:
    monitors = [_Monitor("accum/loss"), _Monitor(3), _Monitor(None, "{epoch}-{accum/grad_norm:.2f}"), _Monitor(None, 7)]
    trainer = _trainer([*monitors, _Quiet()], loggers=[object()], log_every_n_steps=10)
    readers = Readers.of(trainer, log=True, hooks=[], watched=["accum/k"])
    assert readers.wants(3) == Wants(
        True, False, True, True, False, False, frozenset({"accum/loss", "accum/grad_norm", "accum/k"})
    )
    assert readers.wants(20).logs and not readers.any_key
    scheduler = SimpleNamespace(monitor="accum/lr")
    readers = Readers.of(_trainer([], lr_scheduler_configs=[scheduler], progress_bar_callback=object()), True, [])
    assert readers.wants(10) == Wants(True, False, True, False, False, True, frozenset({"accum/lr"}))
    own = _Reader()
    assert not Readers.of(_trainer([own, _Quiet()]), True, [], own=own).any_key
    assert Readers.of(_trainer([own, _Reader()]), True, [], own=own).any_key
    assert Readers.of(_trainer([_StartReader()]), True, []).any_key
    assert Readers.of(_trainer([], module=_ReadingModule()), True, []).any_key
    assert not Readers.of(_trainer([pl.callbacks.LearningRateMonitor()]), True, []).any_key


class _ReadingModule(pl.LightningModule):
    def on_train_batch_end(self, *args: Any) -> None:
        pass


def test_readers_before_are_the_batch_end_readers_listed_before_the_adapters_callback() -> None:
    own = _Quiet()
    lambda_reader = pl.callbacks.LambdaCallback(on_train_batch_end=lambda *args: None)
    trainer = _trainer([_Reader(), _Quiet(), _StartReader(), lambda_reader, own, _Reader()])
    assert readers_before(trainer, own) == ["_Reader", "LambdaCallback"]
    assert readers_before(_trainer([own, _Reader()]), own) == []
    assert readers_before(_trainer([_Reader()]), own) == []  # (not listed)


def test_show_puts_k_and_the_loss_in_the_bar() -> None:
    trainer = _trainer([])
    show(trainer, 3, None)
    assert trainer._logger_connector._progress_bar_metrics == {"accum/k": 3.0}
    assert isinstance(trainer._logger_connector._progress_bar_metrics["accum/k"], float)
    show(trainer, 4, 0.5, prefix="x/")
    assert trainer._logger_connector._progress_bar_metrics == {"accum/k": 3.0, "x/k": 4.0, "x/loss": 0.5}


class _Logger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


def test_publish_puts_every_number_in_callback_metrics_and_writes_the_loggers_steps() -> None:
    logger = _Logger()
    trainer = _trainer([], loggers=[logger], log_every_n_steps=2)
    connector = trainer._logger_connector
    reported = Reported()
    window = _window(step=3, grad_norm=torch.tensor(2.0, dtype=torch.float64), lr={"lr": 0.1})
    reported.publish(trainer, window)
    expected = {
        "k": 3.0,
        "loss": 0.5,
        "grad_norm": 2.0,
        "lr": 0.1,
        "effective_batch": 12.0,
        "samples": 40.0,
        "items": 100.0,
    }
    assert {key: value.item() for key, value in connector._callback_metrics.items()} == {
        f"accum/{name}": pytest.approx(value) for name, value in expected.items()
    }
    assert connector._callback_metrics["accum/k"].dtype == torch.get_default_dtype()
    assert connector._progress_bar_metrics == {"accum/k": 3.0, "accum/loss": 0.5}
    assert logger.logged == [] and connector._logged_metrics == {}  # (not a loggers' step)
    reported.publish(trainer, _window(step=4, grad_norm=torch.tensor(2.0, dtype=torch.float64), lr={"lr": 0.1}))
    ((scalars, step),) = logger.logged
    assert step == 17 and scalars == {f"accum/{name}": value for name, value in expected.items()}
    assert all(type(value) is float for value in scalars.values())
    assert connector._logged_metrics.keys() == scalars.keys()
    assert all(connector._logged_metrics[key] is connector._callback_metrics[key] for key in scalars)
    reported.publish(_trainer([], loggers=[], log_every_n_steps=2), _window(step=4))  # (no logger: nothing written)
    reported.publish(_trainer([], loggers=[logger], log_every_n_steps=0), _window(step=4))
    assert len(logger.logged) == 1


def test_publish_as_a_window_wants() -> None:
    logger = _Logger()
    trainer = _trainer([], loggers=[logger], log_every_n_steps=1)
    connector = trainer._logger_connector
    reported = Reported()
    monitor = Wants(True, False, True, False, False, False, frozenset({"accum/loss"}))
    reported.publish(trainer, _window(step=5), wants=monitor)
    assert list(connector._callback_metrics) == ["accum/loss"] and connector._progress_bar_metrics == {}
    assert logger.logged == []  # (every step is the loggers', but this window's wants says not)
    reported.publish(trainer, _window(step=5, k=2, loss=0.25), wants=monitor._replace(bar=True))
    assert connector._progress_bar_metrics == {"accum/k": 2.0, "accum/loss": 0.25}
    assert connector._callback_metrics["accum/loss"].item() == 0.25
    every = Wants(True, True, True, True, False, False, None)
    reported.publish(trainer, _window(step=5, k=4), prefix="p/", wants=every)
    assert connector._progress_bar_metrics["p/k"] == 4.0 and "p/effective_batch" in connector._callback_metrics
    ((scalars, _),) = logger.logged
    assert scalars["p/k"] == 4.0 and "accum/k" not in scalars


def _kept(reported: Reported, trainer: Any, **changes: Any) -> dict[str, Any]:
    reported.publish(trainer, _window(**changes), wants=Wants(True, False, True, False, False, False, None))
    return dict(trainer._logger_connector._callback_metrics)


def test_a_number_equal_to_the_one_kept_keeps_its_tensor() -> None:
    trainer, reported = _trainer([]), Reported()
    first = _kept(reported, trainer, samples=40)
    assert first["accum/effective_batch"] is first["accum/samples"]  # (equal numbers: one tensor)
    assert first["accum/k"] is not first["accum/samples"]
    second = _kept(reported, trainer, loss=0.25, samples=40)
    assert second["accum/k"] is first["accum/k"] and second["accum/loss"] is not first["accum/loss"]
    assert second["accum/loss"].item() == 0.25
    zero = _kept(reported, trainer, loss=0.0, grad_norm=-0.0)
    assert zero["accum/loss"].item() == 0.0 and math.copysign(1, zero["accum/grad_norm"].item()) == -1
    assert math.copysign(1, zero["accum/loss"].item()) == 1
    minus = _kept(reported, trainer, loss=-0.0, grad_norm=0.0)
    assert math.copysign(1, minus["accum/loss"].item()) == -1 and math.copysign(1, minus["accum/grad_norm"].item()) == 1


def test_a_device_number_is_kept_as_it_is_and_the_next_host_number_replaces_it() -> None:
    trainer, reported = _trainer([]), Reported()
    _kept(reported, trainer, grad_norm=1.0)
    device = torch.tensor(2.0)
    assert _kept(reported, trainer, grad_norm=device)["accum/grad_norm"] is device
    assert _kept(reported, trainer, grad_norm=1.0)["accum/grad_norm"].item() == 1.0


def test_reported_checkpoint_restore_and_clear() -> None:
    trainer, reported = _trainer([]), Reported()
    reported.restore(trainer)
    assert trainer._logger_connector._callback_metrics == {}
    _kept(reported, trainer, loss=0.5)
    state = reported.state_dict()
    assert state["metrics"]["accum/loss"] == 0.5 and state["metrics"]["accum/k"] == 3.0
    assert all(type(value) is float for value in state["metrics"].values())
    resumed = Reported()
    resumed.load_state_dict({"metrics": {"accum/loss": 0.25}})
    fresh = _trainer([])
    resumed.restore(fresh)
    assert {key: value.item() for key, value in fresh._logger_connector._callback_metrics.items()} == {
        "accum/loss": 0.25
    }
    reported.load_state_dict({"metrics": {"accum/loss": 0.25}})  # (the numbers kept before are forgotten)
    assert _kept(reported, trainer, loss=0.5)["accum/loss"].item() == 0.5
    reported.load_state_dict({})
    assert reported.state_dict() == {"metrics": {}}
    _kept(reported, trainer)
    reported.clear()
    assert reported.state_dict() == {"metrics": {}}
    assert _kept(reported, trainer, loss=0.5)["accum/loss"] is not _kept(Reported(), trainer, loss=0.5)["accum/loss"]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        reported.load_state_dict({"metrics": {"accum/loss": 0.1}})
        assert reported._metrics["accum/loss"].dtype == torch.float64 and reported._metrics["accum/loss"].item() == 0.1
        assert _kept(Reported(), _trainer([]), loss=0.1)["accum/loss"].item() == 0.1
    finally:
        torch.set_default_dtype(default)


def test_report_of_a_closing_window() -> None:
    sgd = _optimizer()
    metrics = WindowMetrics()
    engine = SimpleNamespace(
        metrics=metrics, progress=Progress(epoch=2, step=7, samples=70, items=140), used_lrs=[(sgd, [0.1])],
        noise_scale=3.0, seconds=1.5,
    )  # fmt: skip
    closing = Closing(
        4, 3, 12, 24, (), 1.0, 1.0, False, losses={"loss": 0.5, "loss/b": 2.0, "loss/a": 1.0}, norm_sq=9.0
    )
    window = report([sgd], engine, closing, (1, 2), microbatch_size=6)  # type: ignore[arg-type]
    assert window == WindowReport(
        7, 2, 4, 3, 12, 24, 0.5, engine.progress, {"loss/b": 2.0, "loss/a": 1.0}, 3.0, {"lr": 0.1}, 3.0, (1, 2), 6, 1.5
    )
    with pytest.raises(TypeError):
        window.task_losses["x"] = 1.0  # type: ignore[index]
    bare = report([sgd], engine, Closing(4, 3, 12, 24, (), 1.0, 1.0, False))  # type: ignore[arg-type]
    assert bare.loss is None and bare.task_losses is empty() and bare.grad_norm is None and bare.optimizers == (0,)
    assert bare.microbatch_size is None
    alone = report([sgd], engine, closing._replace(losses={"loss": 0.5}, norm_sq=None))  # type: ignore[arg-type]
    assert alone.task_losses is empty() and alone.loss == 0.5 and alone.grad_norm is None
    metrics.tracking = True
    metrics.add_grad_norm([torch.tensor([3.0, 4.0])])
    measured = report([sgd], engine, closing._replace(norm_sq=None))  # type: ignore[arg-type]
    assert isinstance(measured.grad_norm, torch.Tensor) and measured.grad_norm.item() == 5.0
    assert report([sgd], engine, closing._replace(norm_sq=0.0)).grad_norm == 0.0  # type: ignore[arg-type]


class _Heard(pl.Callback):
    def __init__(self, heard: list[Any]) -> None:
        self.heard = heard

    def on_window_end(self, trainer: Any, pl_module: Any, window: Any) -> None:
        self.heard.append((self, trainer, pl_module, window))


class _HeardModule(pl.LightningModule):
    def __init__(self, heard: list[Any]) -> None:
        super().__init__()
        self.heard = heard

    def on_window_end(self, window: Any) -> None:
        self.heard.append((self, window))


class _NotAHook(pl.Callback):
    on_window_end = None


def test_listeners_are_the_callbacks_hooks_then_the_modules() -> None:
    heard: list[Any] = []
    first, second, module = _Heard(heard), _Heard(heard), _HeardModule(heard)
    trainer = _trainer([first, _NotAHook(), _Quiet(), second], module=module)
    hooks = listeners(trainer)
    assert len(hooks) == 3
    announce(hooks, trainer, module, window := _window())
    assert heard == [(first, trainer, module, window), (second, trainer, module, window), (module, window)]
    assert listeners(_trainer([])) == []


class _ModuleSignature(pl.Callback):
    def on_window_end(self, window: Any) -> None:
        pass


class _CallbackSignature(pl.LightningModule):
    def on_window_end(self, trainer: Any, pl_module: Any, window: Any) -> None:
        pass


def test_a_hook_that_cannot_take_what_it_is_handed_is_refused() -> None:
    with pytest.raises(TypeError, match=r"`_ModuleSignature.on_window_end` must take `\(trainer, pl_module, window\)`"):
        listeners(_trainer([_ModuleSignature()]))
    with pytest.raises(TypeError, match=r"`_CallbackSignature.on_window_end` must take the window's report alone"):
        listeners(_trainer([], module=_CallbackSignature()))
    builtin = SimpleNamespace(on_window_end=max)  # (no signature to read: taken as it is)
    assert len(listeners(_trainer([builtin]))) == 1
