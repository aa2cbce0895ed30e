"""Every Lightning built-in callback beside every adapter (issue 42, item 4): one test per row of the table in
``docs/guide/lightning-callbacks.md``, for ``AccumulationScheduler`` without and with ``microbatch_size`` and for
``AccumulationMixin``, each against a plain float64 loop that forms the windows by hand (``plain`` below) or
refused with the reason. Rows tested elsewhere name their tests in the table; this module holds the rest.

One schedule throughout: windows of 3, 3 | 3, 2, 1 over 2 epochs of 6 batches of 8 (k drops to 2 at step 3,
mid-epoch, so the window opening at batch 3 is one Lightning's own value cannot express without the package's
seam, and the epoch ends with a short window). Full masks: a piece's token mean is its sample mean, so pieces of
3 add up to the batch exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BatchSizeFinder,
    DeviceStatsMonitor,
    EarlyStopping,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    OnExceptionCheckpoint,
    SpikeDetection,
    StochasticWeightAveraging,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.nn.utils import prune
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from lightning_accum import AccumulationScheduler, Piecewise, Progress

from helpers import ManualTokenModel, TokenData, TokenModel, loader, make_net, rank_batches, token_losses, trainer

SCHEDULE = Piecewise({0: 3, 3: 2}, unit="step")
DATA = TokenData(48, ragged=False)
ADAPTERS = ["callback", "pieces", "mixin"]
WINDOW_ENDS = [(0, 2), (0, 5), (1, 2), (1, 4), (1, 5)]  # (epoch, batch_idx) of each window's last batch
EXACT = 1e-12


# ---------------------------------------------------------------------------- the reference
class Plain:
    """A plain float64 loop: SGD (momentum 0.9) over hand-made windows of ``SCHEDULE``, each window's gradient
    the mean of its batches' token-mean gradients; hooks for what a callback does between windows."""

    def __init__(
        self,
        batch_size: int = 8,
        lr: float = 0.1,
        frozen: bool = False,
        epoch_start: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None,
        after_step: Callable[[nn.Module], None] | None = None,
        epoch_end: Callable[[nn.Module, int], None] | None = None,
    ) -> None:
        self.net = make_net()
        if frozen:  # (the first layer: the backbone)
            self.net[0].requires_grad_(False)
        params = [p for p in self.net.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        batches = rank_batches(DATA, batch_size)[0]
        self.after: list[dict[str, Tensor]] = []  # the state after each step
        self.losses: list[float] = []  # each window's loss (the mean of its batches' token means)
        self.batch_losses: list[tuple[float, int]] = []  # each batch's token mean, and its window's k
        step = 0
        for epoch in range(2):
            if epoch_start is not None:
                epoch_start(self.net, opt, epoch)
            i = 0
            while i < len(batches):
                k = SCHEDULE(Progress(epoch=epoch, step=step))
                window = batches[i : i + k]
                parts = [(lambda t: t[0] / t[1])(token_losses(self.net, b)) for b in window]
                self.batch_losses += [(float(p.detach()), k) for p in parts]
                loss = sum(parts) / len(window)
                opt.zero_grad()
                loss.backward()  # type: ignore[union-attr]
                opt.step()
                self.losses.append(float(loss.detach()))  # type: ignore[union-attr]
                step, i = step + 1, i + len(window)
                if after_step is not None:
                    after_step(self.net)
                self.after.append(state(self.net))
            if epoch_end is not None:
                epoch_end(self.net, epoch)


def state(net: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------------------- the adapters
class Returning(ManualTokenModel):
    """The mixin's model, returning its batch's (token-mean) loss from ``training_step`` as Lightning allows in
    manual optimization, for the callbacks that read ``outputs`` (``SpikeDetection``)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:  # type: ignore[override]
        super().training_step(batch, batch_idx)
        with torch.no_grad():
            total, tokens = token_losses(self.net, batch)
        return total / tokens


def fit(
    adapter: str,
    callbacks: list[pl.Callback],
    auto: type[TokenModel] = TokenModel,
    manual: type[ManualTokenModel] = Returning,
    own_loader: bool = False,
    **kwargs: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    """``callbacks`` beside ``adapter`` ("callback", "pieces": ``microbatch_size=3``, "mixin") on ``DATA``
    (``own_loader``: the model's ``train_dataloader``, which the tuners resize)."""
    model: pl.LightningModule
    if adapter == "mixin":
        model = manual(schedule=SCHEDULE)
    else:
        model = auto()
        size = 3 if adapter == "pieces" else None
        callbacks = [AccumulationScheduler(SCHEDULE, microbatch_size=size), *callbacks]
    t = trainer(callbacks=callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Lightning's advice on workers, flops, manual checkpoints)
        t.fit(model, None if own_loader else loader(DATA, 8))
    return t, model


# ---------------------------------------------------------------------------- the observers, one fit per adapter
class Memory(Logger):
    """A logger that keeps what it is given: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class Throughput(ThroughputMonitor):
    """``ThroughputMonitor`` recording where it measures (it measures when Lightning's loop says a window
    ended: ``not trainer.fit_loop._should_accumulate()``)."""

    def __init__(self) -> None:
        super().__init__(batch_size_fn=lambda batch: len(batch["x"]))
        self.measured: list[tuple[int, int]] = []

    def _compute(self, trainer: pl.Trainer, iter_num: int | None = None) -> None:
        self.measured.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))
        super()._compute(trainer, iter_num)


class Outputs(pl.Callback):
    """What a callback reading ``outputs`` (as ``SpikeDetection`` does) sees at each batch's end."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


OBSERVED: dict[str, Any] = {}


@pytest.fixture(scope="module", params=ADAPTERS)
def observed(request: Any, tmp_path_factory: Any) -> Iterator[dict[str, Any]]:
    """One fit per adapter with every callback that watches and does not change the optimisation."""
    adapter, tmp = request.param, tmp_path_factory.mktemp(request.param)
    seen = dict(
        adapter=adapter,
        tmp=tmp,
        lr=LearningRateMonitor("step"),
        throughput=Throughput(),
        checkpoint=ModelCheckpoint(tmp / "ckpt", "{step}", every_n_train_steps=1, save_top_k=-1),
        stopping=EarlyStopping("accum/loss", patience=100, check_on_train_epoch_end=True),
        on_exception=OnExceptionCheckpoint(tmp / "exception"),
        timer=Timer(),
        device=DeviceStatsMonitor(cpu_stats=True),
        spike=SpikeDetection(exclude_batches_path=tmp / "skip.json"),
        bar=TQDMProgressBar(),
        logger=Memory(),
    )
    callbacks = [seen[k] for k in ("lr", "throughput", "stopping", "on_exception", "timer", "device", "spike")]
    t, model = fit(
        adapter,
        [*callbacks, seen["bar"], seen["checkpoint"]],
        logger=seen["logger"],
        log_every_n_steps=1,
        enable_checkpointing=True,
        enable_progress_bar=True,
        default_root_dir=tmp,
    )
    seen.update(trainer=t, model=model)
    yield seen


REFERENCE = Plain()


def test_observers_leave_every_adapter_exact(observed: dict[str, Any]) -> None:
    """LearningRateMonitor, ThroughputMonitor, ModelCheckpoint, EarlyStopping, OnExceptionCheckpoint, Timer,
    DeviceStatsMonitor, SpikeDetection and TQDMProgressBar all in one fit: the reference's parameters."""
    assert diff(state(observed["model"].net), REFERENCE.after[-1]) <= EXACT
    assert observed["trainer"].global_step == len(WINDOW_ENDS)


def test_model_checkpoint_every_step_holds_that_steps_parameters(observed: dict[str, Any]) -> None:
    """``every_n_train_steps=1``: one file per optimizer step (not per batch), holding the parameters after that
    step (the mixin too: Lightning's manual path saves at the batch that stepped)."""
    files = sorted((observed["tmp"] / "ckpt").glob("step=*.ckpt"), key=lambda f: int(f.stem.split("=")[1]))
    assert [f.stem for f in files] == [f"step={s}" for s in range(1, len(WINDOW_ENDS) + 1)]
    for f, want in zip(files, REFERENCE.after, strict=True):
        saved = torch.load(f, weights_only=False)["state_dict"]
        assert diff({k.removeprefix("net."): v for k, v in saved.items()}, want) <= EXACT


def test_early_stopping_watches_each_epochs_last_window_loss(observed: dict[str, Any]) -> None:
    """``EarlyStopping("accum/loss", check_on_train_epoch_end=True)`` compares the last window's true loss of each
    epoch (the reference's windows 2 and 5): to 1e-12, or its float32 rounding where Lightning logged the value in
    the default dtype (the callback's ``self.log`` of a float)."""
    best, want = observed["stopping"].best_score, min(REFERENCE.losses[1], REFERENCE.losses[4])
    rounded = float(torch.tensor(want, dtype=torch.float32))
    assert (abs(float(best) - want) <= EXACT) if best.dtype == torch.float64 else float(best) == rounded


def test_on_exception_checkpoint_writes_nothing_without_an_exception(observed: dict[str, Any]) -> None:
    """(A checkpoint written on an exception inside a window, and its resume: tests/test_faults.py and the
    differential fuzzer's interruptions.)"""
    assert not (observed["tmp"] / "exception").exists()


def test_learning_rate_monitor_logs_once_per_optimizer_step(observed: dict[str, Any]) -> None:
    """Keyed by Lightning's step counter: optimizer steps in automatic optimization; in manual optimization
    Lightning counts every batch (``_batches_that_stepped``), the mixin's included."""
    steps = sorted({s for s, m in observed["logger"].rows if "lr-SGD" in m})
    assert all(m["lr-SGD"] == 0.1 for _, m in observed["logger"].rows if "lr-SGD" in m)
    assert steps == (list(range(12)) if observed["adapter"] == "mixin" else list(range(5)))


def test_throughput_monitor_measures_at_each_window_end(observed: dict[str, Any]) -> None:
    """It measures when Lightning's loop says no more accumulation (the package's windows under the callback,
    unaligned and short ones included); in manual optimization Lightning's loop knows no windows: every batch."""
    every_batch = [(e, b) for e in range(2) for b in range(6)]
    assert observed["throughput"].measured == (every_batch if observed["adapter"] == "mixin" else WINDOW_ENDS)
    assert sum(observed["throughput"]._samples.values()) == 2 * 48  # loader batches, not pieces


def test_timer_and_device_stats_monitor_run(observed: dict[str, Any]) -> None:
    assert observed["timer"].time_elapsed("train") > 0
    assert any(any(k.startswith("DeviceStatsMonitor") for k in m) for _, m in observed["logger"].rows)


def test_spike_detection_sees_every_batch(observed: dict[str, Any]) -> None:
    """No spike in this run: every batch's loss went into its running mean (the mixin's model returns its loss
    from ``training_step``; one that returns None gives ``outputs == {}``, which SpikeDetection cannot read)."""
    assert int(observed["spike"].running_mean.window) == 10
    assert not (observed["tmp"] / "skip.json").exists()


def test_progress_bar_counts_loader_batches(observed: dict[str, Any]) -> None:
    bar = observed["bar"].train_progress_bar
    assert (bar.n, bar.total) == (6, 6)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_rich_progress_bar(adapter: str) -> None:
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar

    bar = RichProgressBar()
    t, model = fit(adapter, [bar], enable_progress_bar=True)
    assert t.progress_bar_callback is bar
    assert diff(state(model.net), REFERENCE.after[-1]) <= EXACT


# ---------------------------------------------------------------------------- callbacks that change the run
class _Backbone:
    """The first layer is the backbone; the optimizer holds what trains at fit start, as BaseFinetuning asks."""

    net: nn.Sequential

    @property
    def backbone(self) -> nn.Module:
        return self.net[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)  # type: ignore[attr-defined]


class Backboned(_Backbone, TokenModel):
    pass


class BackbonedManual(_Backbone, Returning):
    pass


def _unfreeze(net: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> None:
    if epoch == 1:  # BackboneFinetuning: a group of the backbone at 0.1 x the LR in force
        net[0].requires_grad_(True)
        opt.add_param_group({"params": list(net[0].parameters()), "lr": 0.01})


@pytest.mark.parametrize(
    "adapter",
    ["callback", "pieces", "mixin"],
)
def test_backbone_finetuning_unfreezes_into_a_new_group(adapter: str) -> None:
    """BaseFinetuning/BackboneFinetuning: the backbone frozen at fit start, unfrozen at epoch 1 into a param
    group added to the optimizer (before that epoch's first window)."""
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1, verbose=False)
    _, model = fit(adapter, [finetuning], Backboned, BackbonedManual)
    assert diff(state(model.net), Plain(frozen=True, epoch_start=_unfreeze).after[-1]) <= EXACT


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_model_pruning_between_windows(adapter: str) -> None:
    """ModelPruning reparametrises each weight (``weight_orig`` times a mask, in a forward pre-hook) at each
    epoch's end and makes it permanent at the fit's end; its reference is torch's pruning in the plain loop."""

    def pruned(net: nn.Module, epoch: int) -> None:
        for layer in (net[0], net[2]):
            prune.l1_unstructured(layer, "weight", amount=0.3)

    pruning = ModelPruning(
        "l1_unstructured", amount=0.3, use_global_unstructured=False, use_lottery_ticket_hypothesis=False,
        parameter_names=["weight"], verbose=0,
    )  # fmt: skip
    _, model = fit(adapter, [pruning])
    reference = Plain(epoch_end=pruned)
    for layer in (reference.net[0], reference.net[2]):
        prune.remove(layer, "weight")
    assert diff(state(model.net), state(reference.net)) <= EXACT
    assert float((model.net[0].weight == 0).double().mean()) == 0.5  # (0.3, then 0.3 of the rest: 12 of 24)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_ema_weight_averaging_averages_once_per_window(adapter: str) -> None:
    """EMAWeightAveraging updates its average when ``trainer.global_step`` moves (once per window) and puts the
    average into the model at the fit's end."""
    averaged: list[AveragedModel] = []

    def update(net: nn.Module) -> None:
        if not averaged:
            averaged.append(AveragedModel(net, avg_fn=get_ema_avg_fn(0.5), use_buffers=True))
        averaged[0].update_parameters(net)

    _, model = fit(adapter, [EMAWeightAveraging(decay=0.5)])
    Plain(after_step=update)
    assert diff(state(model.net), state(averaged[0].module)) <= EXACT


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_gradient_accumulation_scheduler_is_refused(adapter: str) -> None:
    """The callback refuses a second accumulation callback (tests/test_callback.py has the dict drop-in); in
    manual optimization Lightning refuses it itself. Before any batch: the parameters are untouched."""
    with pytest.raises((ValueError, RuntimeError), match="GradientAccumulationScheduler") as raised:
        fit(adapter, [GradientAccumulationScheduler({0: 2})])
    if adapter != "mixin":
        assert "a dict schedule replaces" in str(raised.value)


class Sized(TokenModel):
    """A model with ``batch_size`` and ``lr`` attributes and its own loader, as the tuners want."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2

    def train_dataloader(self) -> Any:
        return loader(DATA, self.batch_size)


class SizedManual(Returning):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batch_size = 2

    def train_dataloader(self) -> Any:
        return loader(DATA, self.batch_size)


@pytest.mark.parametrize("adapter", ["callback", "pieces"])
def test_batch_size_finder_then_the_fit_is_exact(adapter: str) -> None:
    """BatchSizeFinder's trial steps (the Trainer's callbacks taken away, its state restored after) leave nothing
    behind: the fit at the batch size found (2 -> 4 in 2 trials) equals the reference at that size."""
    finder = BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=2)
    _, model = fit(adapter, [finder], Sized, own_loader=True)
    assert model.batch_size == 4
    assert diff(state(model.net), Plain(batch_size=4).after[-1]) <= EXACT


@pytest.mark.parametrize("adapter", ["callback", "pieces"])
def test_learning_rate_finder_then_the_fit_is_exact(adapter: str) -> None:
    """LearningRateFinder's search runs with the Trainer's callbacks swapped for its own (k = 1, as Lightning's
    own loop), then restores the model: the fit at the LR found equals the reference at that LR."""
    finder = LearningRateFinder(min_lr=1e-3, max_lr=0.5, num_training_steps=20, early_stop_threshold=None)
    _, model = fit(adapter, [finder], Sized, own_loader=True)
    assert model.lr != 0.1  # (a suggestion was made)
    assert diff(state(model.net), Plain(batch_size=2, lr=model.lr).after[-1]) <= EXACT


@pytest.mark.parametrize("finder", [BatchSizeFinder, LearningRateFinder])
def test_tuners_are_refused_beside_the_mixin(finder: type[pl.Callback]) -> None:
    """The tuners run their trial steps with the Trainer's callbacks taken away, the mixin's own among them, so
    ``self.accumulate`` cannot run there: refused as the fit sets up, naming the tuner and the way out (it said
    that an override of ``configure_callbacks`` dropped the mixin's callback, at the first trial batch)."""
    model = SizedManual(schedule=SCHEDULE)
    before = state(model.net)
    with pytest.raises(RuntimeError, match=rf"`{finder.__name__}`.*AccumulationScheduler"):
        trainer(callbacks=[finder()]).fit(model)
    assert diff(state(model.net), before) == 0


class Normed(Returning):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(8, 1)).double()


def test_swa_with_batchnorm_is_refused_beside_the_mixin() -> None:
    """StochasticWeightAveraging with BatchNorm adds an epoch that recomputes the running statistics with the
    averaged weights, forward only: Lightning skips the backward pass in automatic optimization (the callback's
    row: tests/test_misuse.py, tests/test_split.py), but the mixin's blocks back-propagated and stepped there
    (0.055 away from the average). Refused as the fit starts; without BatchNorm SWA runs (the differential
    fuzzer draws SWA for every adapter)."""
    model = Normed(schedule=SCHEDULE)
    before = state(model.net)
    with pytest.raises(RuntimeError, match=r"StochasticWeightAveraging.*BatchNorm.*AccumulationScheduler"):
        fit("mixin", [StochasticWeightAveraging(swa_lrs=0.05)], manual=lambda schedule: model)  # type: ignore[arg-type]
    assert diff(state(model.net), before) == 0


class RunsOut(Timer):
    """A Timer whose time runs out at the first batch's end (its clock read as 0 s before, as a day after)."""

    def __init__(self) -> None:
        super().__init__(duration=dict(hours=1))
        self.batches = 0

    def time_elapsed(self, stage: Any = "train") -> float:
        return 86400.0 if self.batches else 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.batches += 1
        super().on_train_batch_end(trainer, *args, **kwargs)


@pytest.mark.parametrize("adapter", ["builtin", *ADAPTERS])
def test_timer_stopping_inside_a_window_steps_nothing(adapter: str) -> None:
    """A ``Timer`` that runs out at the first batch's end stops the fit inside the first window: no step, as in
    Lightning's own loop (``builtin``: ``accumulate_grad_batches=3``)."""
    timer = RunsOut()
    if adapter == "builtin":
        t, model = trainer(callbacks=[timer], accumulate_grad_batches=3), TokenModel()
        t.fit(model, loader(DATA, 8))
    else:
        t, model = fit(adapter, [timer])
    assert t.global_step == 0 and t.fit_loop.epoch_loop.batch_progress.total.completed == 1
    assert diff(state(model.net), state(make_net())) == 0


@pytest.mark.parametrize("adapter", ["callback", "pieces"])
def test_outputs_loss_is_divided_by_the_windows_k(adapter: str) -> None:
    """What ``on_train_batch_end`` hands callbacks (``SpikeDetection``) is the batch's loss divided by the window's
    k, as in Lightning's own loop (its short last window included: k, not the batches it holds), also for a window
    opening at batch r not a multiple of k, where the callback steers Lightning's stepping with
    ``accumulate_grad_batches = r + k`` (the window of 2 at batch 3; the last one, of 1 batch, divided by 2)."""
    seen = Outputs()
    fit(adapter, [seen])
    want = [loss / k for loss, k in REFERENCE.batch_losses]
    assert max(abs(a - b) for a, b in zip(seen.losses, want, strict=True)) <= EXACT
