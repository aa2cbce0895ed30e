"""Fails if Lightning changes the loop arithmetic and internals that `lightning_accum/_seam.py` relies on."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_accum import AccumulationScheduler, Piecewise
from lightning_accum._core.window import lightning_divisor
from lightning_accum._seam import (
    DROPPED_SCHEDULER_KEYS,
    ENDED,
    SCHEDULER_KEYS,
    LoopCounters,
    Upcoming,
    after_module_hook,
    at_pass_end,
    at_plateau_point,
    backward_skipped,
    batch_processed,
    batches_ran_out,
    ddp_comm_hook,
    epoch_ends_after_this_batch,
    guard_zero_grad,
    keep_progress_consistent,
    keep_scheduler_keys,
    loop_skips_sync,
    resume_after_finished_epoch,
    route_training_step,
    set_divisor,
    set_up_training_loader,
    show_in_progress_bar,
    step_plateau_after_resume,
    steps_counted,
    suspend_clipping,
    uncount_step,
    write_to_loggers,
    zero_grad_like_lightning,
    zeroes_after_training_step,
)

from helpers import ManualTokenModel, ResumableLoader, TokenData, TokenModel, loader, trainer


@given(st.integers(0, 500), st.integers(1, 64))
def test_divisor_closes_the_window_exactly(start: int, k: int) -> None:
    """Lightning's rules, written out: step after batch i if (i + 1) % value == 0, zero before
    batch i if i % value == 0. With the divisor, the first step point from ``start`` on is
    ``start + k - 1``, and ``start`` is a zero point or the caller is told to zero."""
    value = lightning_divisor(start, k)
    steps = [i for i in range(start, start + k) if (i + 1) % value == 0]
    zeros = [i for i in range(start + 1, start + k) if i % value == 0]
    assert steps == [start + k - 1]
    assert zeros == []


class Recorder(pl.Callback):
    """Sets an arbitrary divisor at chosen batches, as the package does, and records what
    Lightning then does: where it zeroes, where it steps, what it divides the loss by."""

    def __init__(self, plan: dict[int, int]) -> None:
        self.plan, self.events = plan, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.plan:
            set_divisor(trainer, self.plan[batch_idx])
        self.batch_idx = batch_idx

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.events.append(("zero", self.batch_idx))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.events.append(("step", self.batch_idx))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
        self.events.append(("divided_by", round(float(pl_module.raw_loss / loss.detach()))))


class RawLossModel(TokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.raw_loss = loss.detach()
        return loss


def test_lightning_loop_arithmetic() -> None:
    # 11 batches; windows: [0, 1] (value 2), [2..4] (value 2 + 3 = 5), [5..9] (value 5 + 5 = 10), [10] (last)
    recorder = Recorder({0: 2, 2: 5, 5: 10})
    trainer(callbacks=[recorder], max_epochs=1).fit(RawLossModel(), loader(TokenData(44), 4))
    steps = [i for what, i in recorder.events if what == "step"]
    zeros = [i for what, i in recorder.events if what == "zero"]
    divided = [d for what, d in recorder.events if what == "divided_by"]
    assert steps == [1, 4, 9, 10]
    assert zeros == [0, 10]  # Lightning zeroes only at multiples of the value; the package zeroes 2 and 5
    assert divided == [2, 2, 5, 5, 5, 10, 10, 10, 10, 10, 10]


class DividedByK(RawLossModel):
    """Sets the divisor to the window's k as ``training_step`` returns, as the callback's routed ``training_step``
    does for an unaligned window (windows of 2, 3, 5, 1 as in ``test_lightning_loop_arithmetic``)."""

    K = [2, 2, 3, 3, 3, 5, 5, 5, 5, 5, 1]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.stepping = self.trainer.accumulate_grad_batches
        set_divisor(self.trainer, self.K[batch_idx])
        return loss


class PutsBack(Recorder):
    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        set_divisor(trainer, pl_module.stepping)


def test_loss_divisor_is_read_as_training_step_returns() -> None:
    """Lightning divides the loss by the value in force when ``training_step`` returns, and reads it for nothing
    else before the loss's backward: the callback sets the window's k there and puts the stepping value back in
    ``on_before_backward`` (``AccumulationScheduler._training_step``); steps and zeroing stay where they were."""
    recorder = PutsBack({0: 2, 2: 5, 5: 10})
    trainer(callbacks=[recorder], max_epochs=1).fit(DividedByK(), loader(TokenData(44), 4))
    assert [i for what, i in recorder.events if what == "step"] == [1, 4, 9, 10]
    assert [i for what, i in recorder.events if what == "zero"] == [0, 10]
    assert [d for what, d in recorder.events if what == "divided_by"] == DividedByK.K


class Seams(pl.Callback):
    """Reads the other seams at the points the package reads them."""

    def __init__(self) -> None:
        self.processed: list[tuple[str, bool]] = []
        self.skipped: list[bool] = []

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self.processed.append(("backward", batch_processed(trainer)))
        self.skipped.append(backward_skipped(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.processed.append(("batch_end", batch_processed(trainer)))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:  # an unaligned zeroing, as the package makes it: Lightning's counters follow
            optimizer = trainer.optimizers[0]
            before = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad.total
            count = before.completed
            zero_grad_like_lightning(trainer, batch_idx, optimizer)
            assert before.completed == count + 1 and before.ready == before.started == before.completed
            assert all(p.grad is None for p in pl_module.parameters())


def test_progress_skip_and_zero_grad_seams() -> None:
    seams = Seams()
    trainer(callbacks=[seams], max_epochs=1).fit(RawLossModel(), loader(TokenData(12), 4))
    assert seams.processed == [("backward", False), ("batch_end", True)] * 3
    assert seams.skipped == [False] * 3
    loop = pl.Trainer(logger=False).fit_loop
    loop._skip_backward = True  # what StochasticWeightAveraging sets for its BatchNorm epoch
    assert backward_skipped(type("T", (), {"fit_loop": loop})())


class BarReader(pl.Callback):
    """What the progress bar would draw after each batch."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        bar = trainer.progress_bar_callback
        assert bar is not None
        self.seen.append(float(bar.get_metrics(trainer, pl_module)["accum/k"]))


def test_progress_bar_metrics_seam_shows_the_k_in_force_every_step() -> None:
    """``show_in_progress_bar`` writes where the bar reads, and ``self.log`` (every
    ``log_every_n_steps``) does not overwrite it with a stale value between logged steps."""
    reader = BarReader()
    schedule = Piecewise({0: 1, 3: 2, 5: 3}, unit="step")  # steps 0-2: k=1, 3-4: k=2, then 3
    callback = AccumulationScheduler(schedule)
    trainer(callbacks=[callback, reader], max_epochs=1, enable_progress_bar=True, log_every_n_steps=50).fit(
        RawLossModel(), loader(TokenData(16), 1)
    )
    # the k of the window that closed last: windows end after batches 0, 1, 2 | 4, 6 | 9, 12, 15
    assert reader.seen == [1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    probe = pl.Trainer(logger=False, enable_progress_bar=False)
    show_in_progress_bar(probe, "x", 2.0)
    assert probe.progress_bar_metrics["x"] == 2.0


class StepSeams(pl.Callback):
    """The seams an optimizer step that moves nothing, and the end of an epoch, lean on."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.ran_out: list[bool] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        restore = suspend_clipping(trainer)
        assert trainer.gradient_clip_val is None
        restore()
        assert trainer.gradient_clip_val == 0.5

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        before = trainer.global_step
        uncount_step(trainer)  # every step: global_step stays 0, and `max_steps` never ends the fit
        assert trainer.global_step == before - 1
        self.steps.append(trainer.global_step)
        self.ran_out.append(batches_ran_out(trainer))

    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        assert trainer.fit_loop.restarting is False
        step_plateau_after_resume(trainer)
        assert trainer.fit_loop._restarting is False


def test_step_and_epoch_end_seams() -> None:
    seams = StepSeams()
    t = trainer(callbacks=[seams], max_epochs=1, max_steps=2, gradient_clip_val=0.5)
    t.fit(RawLossModel(), loader(TokenData(12), 4))
    assert seams.steps == [0, 0, 0]  # all 3 batches ran though max_steps=2: Lightning reads the counter uncounted
    assert seams.ran_out == [False, False, True]


class HeldCounters(pl.Callback):
    """Holds the loop counters from train start (as the callback does) and checks them against the Trainer's
    properties at every step and batch: through a resume from a checkpoint, a step taken back, `max_steps`,
    `limit_train_batches` and an iterable dataset's last batch."""

    def __init__(self) -> None:
        self.checked, self.lasts, self.taken_back = 0, [], False

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counters = LoopCounters(trainer)
        assert self.counters.steps.completed == trainer.global_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        step, batch_idx = trainer.global_step + 1, trainer.fit_loop.epoch_loop.batch_idx
        last = self.counters.last_window(step, batch_idx)
        assert last == (trainer.max_steps == step or epoch_ends_after_this_batch(trainer))
        self.lasts.append(last)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        assert self.counters.steps.completed == trainer.global_step > 0
        if trainer.global_step == 3 and not self.taken_back:
            uncount_step(trainer)
            self.taken_back = True
            assert self.counters.steps.completed == trainer.global_step == 2
        self.checked += 1


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """An iterable dataset of `n` token batches: the loop learns its last batch from the fetcher only."""

    def __init__(self, n: int) -> None:
        self.data = TokenData(n)

    def __iter__(self) -> Any:
        return iter(self.data[i] for i in range(len(self.data)))


def test_loop_counters_seam(tmp_path: Any) -> None:
    saves = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    first = HeldCounters()
    t = trainer(callbacks=[first, saves], max_steps=4, enable_checkpointing=True)
    t.fit(RawLossModel(), loader(TokenData(24), 4))
    resumed = HeldCounters()
    t = trainer(callbacks=[resumed], max_steps=6)
    t.fit(RawLossModel(), loader(TokenData(24), 4), ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt"))
    assert (first.checked, resumed.checked, t.global_step) == (5, 5, 6)
    assert first.lasts[-1] and resumed.lasts[-1] and resumed.lasts[3]  # (max_steps; the first epoch's end)
    limited = HeldCounters()
    trainer(callbacks=[limited], max_epochs=2, limit_train_batches=3).fit(RawLossModel(), loader(TokenData(24), 4))
    assert limited.lasts == [False, False, True] * 2
    streamed = HeldCounters()
    trainer(callbacks=[streamed], max_epochs=1).fit(RawLossModel(), loader(Stream(12), 4))
    assert streamed.lasts == [False, False, True]


class ProgressSeams(pl.Callback):
    """Lightning's batch and epoch counters, put off as a second resume finds them, and put right."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        loop = trainer.fit_loop
        batches, epochs = loop.epoch_loop.batch_progress, loop.epoch_progress
        want = (batches.total.ready, batches.total.started, epochs.total.ready, epochs.current.processed)
        batches.total.ready += 1  # a batch counted twice
        epochs.total.ready -= 1  # an epoch not counted as started
        keep_progress_consistent(trainer)
        assert (batches.total.ready, batches.total.started, epochs.total.ready, epochs.current.processed) == want
        if trainer.current_epoch == 1 and batch_idx == 0:  # what a checkpoint written after an epoch's end holds
            saved = batches.current.state_dict()
            batches.current.completed = trainer.num_training_batches
            epochs.current.ready = epochs.current.started = 1
            loop._restarting = True
            resume_after_finished_epoch(trainer)
            assert batches.current.completed == 0
            loop._restarting = False
            epochs.current.ready = epochs.current.started = 2
            batches.current.load_state_dict(saved)


def test_progress_seams() -> None:
    trainer(callbacks=[ProgressSeams()], max_epochs=2).fit(RawLossModel(), loader(TokenData(12), 4))


class PlateauManual(ManualTokenModel):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        step = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        self.configs = [
            {"scheduler": plateau, "monitor": "x", "strict": False},
            {"scheduler": step, "interval": "step", "reduce_on_plateau": False},
        ]
        return [optimizer], self.configs


def test_scheduler_keys_are_kept_from_configure_optimizers() -> None:
    """Lightning drops `monitor`, `strict` and `reduce_on_plateau` in manual optimization, and warns that it
    ignores them; the seam catches them first and hands Lightning copies without them (no warning)."""
    model, found = PlateauManual(step_schedulers=False), {}  # type: ignore[var-annotated]
    keep_scheduler_keys(model, found, lambda: True)
    t = trainer(max_epochs=1, limit_train_batches=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*keys will be ignored.*")
        t.fit(model, loader(TokenData(8), 4))
    plateau, step = (c.scheduler for c in t.lr_scheduler_configs)
    assert t.lr_scheduler_configs[1].interval == "step"
    assert found == {id(plateau): ("x", False, None), id(step): (None, True, False)}
    assert model.configs[0] == {"scheduler": plateau, "monitor": "x", "strict": False}  # the user's, as they were
    assert "configure_optimizers" not in vars(model)  # the class's method again
    with pytest.warns(RuntimeWarning, match="keys will be ignored"):  # (Lightning's, where they are not honoured)
        other, also = PlateauManual(step_schedulers=False), {}  # type: ignore[var-annotated]
        keep_scheduler_keys(other, also, lambda: False)
        trainer(max_epochs=1, limit_train_batches=1).fit(other, loader(TokenData(8), 4))
    assert len(also) == 2


class EpochEnds(ManualTokenModel):
    """Records the order of the epoch-end hooks, with a step set up to run after the module's."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def on_train_epoch_end(self) -> None:
        self.order.append("module")


class MonitoringLike(pl.callbacks.EarlyStopping):
    def __init__(self, order: list[str]) -> None:
        super().__init__(monitor="x", check_on_train_epoch_end=False)
        self.order = order

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.order.append("monitoring callback")


class SetsUp(pl.Callback):
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.order.append("callback")
        after_module_hook(pl_module, "on_train_epoch_end", lambda: self.order.append("after the module"))


def test_after_module_hook_runs_right_after_the_modules_epoch_end() -> None:
    """Lightning calls the module's hook by `getattr` after the callbacks' and before the monitoring ones."""
    model = EpochEnds()
    trainer(callbacks=[MonitoringLike(model.order), SetsUp(model.order)], max_epochs=2).fit(
        model, loader(TokenData(8), 4)
    )
    epoch = ["callback", "module", "after the module", "monitoring callback"]
    assert model.order == epoch * 2
    assert "on_train_epoch_end" not in vars(model)
    undo = after_module_hook(model, "on_train_epoch_end", lambda: None)
    assert "on_train_epoch_end" in vars(model)
    undo()
    assert "on_train_epoch_end" not in vars(model)


class LogsAndWrites(TokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("own", 1.0)
        write_to_loggers(self.trainer, {"mine": 2.0}, {"mine": torch.tensor(2.0)})
        return super().training_step(batch, batch_idx)


def test_write_to_loggers_keeps_logged_metrics_as_lightning_does(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import CSVLogger

    t = trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(LogsAndWrites(), loader(TokenData(8), 4))
    assert isinstance(t.logged_metrics["own"], torch.Tensor)  # (what Lightning keeps for `self.log`)
    assert isinstance(t.logged_metrics["mine"], torch.Tensor) and float(t.logged_metrics["mine"]) == 2.0
    assert "mine" in (tmp_path / "lightning_logs/version_0/metrics.csv").read_text()


class CountsSteps(TokenModel):
    def configure_optimizers(self) -> Any:
        release = set_up_training_loader(self.trainer)
        self.batches = self.trainer.num_training_batches
        assert self.trainer.fit_loop._combined_loader is not None
        release()
        return super().configure_optimizers()


def test_training_loader_seam(tmp_path: Any) -> None:
    model = CountsSteps()
    trainer(max_epochs=1).fit(model, loader(TokenData(12), 4))
    assert model.batches == 3


class Indexed(ManualTokenModel):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        from lightning_accum._seam import batch_index

        assert batch_index(self.trainer) == batch_idx
        super().training_step(batch, batch_idx)


def test_batch_index_seam() -> None:
    trainer(max_epochs=2).fit(Indexed(schedule=2), loader(TokenData(12), 4))


def test_attached_seam() -> None:
    model = TokenModel()
    from lightning_accum._seam import attached

    assert not attached(model)
    trainer(max_epochs=1).fit(model, loader(TokenData(8), 4))
    assert attached(model)


class StepsAtBatchEnd(pl.LightningModule):
    """Manual optimization stepping in `on_train_batch_end` (outside `training_step`), counted or not."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer, self.counted = torch.nn.Linear(3, 1).double(), counted

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.manual_backward(self.layer(batch["x"]).sum())

    def on_train_batch_end(self, *args: Any) -> None:
        with steps_counted(self.trainer) if self.counted else contextlib.nullcontext():
            self.optimizers().step()  # type: ignore[union-attr]
        self.optimizers().zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("counted", [True, False])
def test_steps_counted_seam(counted: bool) -> None:
    t = trainer(max_epochs=1)
    t.fit(StepsAtBatchEnd(counted), loader(TokenData(12), 4))
    assert t.global_step == (3 if counted else 0)  # (Lightning counts none of them by itself)
    assert all(o._on_before_step.__name__ == "do_nothing_closure" for o in t.strategy._lightning_optimizers)


class ZeroRule(Recorder):
    """Also records, at each batch's start, where the package expects Lightning to zero after `training_step`."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if zeroes_after_training_step(trainer, batch_idx):
            self.events.append(("expected_zero", batch_idx))

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        super().on_before_zero_grad(trainer, pl_module, optimizer)
        assert pl_module.stepped == self.batch_idx  # (after this batch's `training_step`: the closure runs it first)


class SteppedModel(RawLossModel):
    stepped = -1

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.stepped = batch_idx
        return super().training_step(batch, batch_idx)


def test_zeroing_after_training_step_seam() -> None:
    """Lightning zeroes after `training_step` exactly where `zeroes_after_training_step` says."""
    recorder = ZeroRule({0: 2, 2: 5, 5: 10})
    trainer(callbacks=[recorder], max_epochs=1).fit(SteppedModel(), loader(TokenData(44), 4))
    zeros = [i for what, i in recorder.events if what == "zero"]
    assert zeros == [i for what, i in recorder.events if what == "expected_zero"] == [0, 10]


def test_route_training_step_seam() -> None:
    """Lightning calls the routed step (through `Strategy.training_step`) with the arguments the module's own
    `training_step` takes; undoing it gives the module its own method (or an instance attribute it had) back."""
    calls: list[tuple[Any, ...]] = []

    def step(original: Any, *args: Any) -> Any:
        calls.append(tuple(type(a).__name__ for a in args))
        return original(*args)

    class NoIndex(TokenModel):
        def training_step(self, batch: Any) -> Any:  # type: ignore[override]
            return super().training_step(batch, 0)

    for model, want in ((TokenModel(), ("dict", "int")), (NoIndex(), ("dict",))):
        calls.clear()
        restore = route_training_step(model, step)
        trainer(max_epochs=1).fit(model, loader(TokenData(8), 4))
        restore()
        assert calls == [want, want] and "training_step" not in vars(model)
    model = TokenModel()
    own = model.training_step
    model.training_step = own  # type: ignore[method-assign]
    route_training_step(model, step)()
    assert vars(model)["training_step"] is own


def test_ddp_comm_hook_seam() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    assert ddp_comm_hook(DDPStrategy(ddp_comm_hook=print)) is print
    assert ddp_comm_hook(DDPStrategy()) is None


def test_loop_skips_sync_seam() -> None:
    """Lightning's ``block_backward_sync`` enters ``no_sync()`` of any wrapped model that has one (FSDP's root
    too), which ``_seam.loop_skips_sync`` reports; a model without one, or one device, is left alone."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    class WithNoSync(torch.nn.Linear):
        entered = 0

        @contextlib.contextmanager
        def no_sync(self) -> Any:
            WithNoSync.entered += 1
            yield

    strategy = DDPStrategy()
    strategy.model = WithNoSync(2, 2)
    with strategy.block_backward_sync():
        pass
    assert WithNoSync.entered == 1 and loop_skips_sync(strategy)
    strategy.model = torch.nn.Linear(2, 2)
    assert not loop_skips_sync(strategy)
    single = SingleDeviceStrategy(device=torch.device("cpu"))
    single.model = WithNoSync(2, 2)
    assert not loop_skips_sync(single)


class PlateauPoint(pl.LightningModule):
    """Manual optimization: records the order of a batch's `on_train_batch_end`, its validation and the seam's
    plateau point."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer, self.order = torch.nn.Linear(3, 1).double(), []  # type: ignore[var-annotated]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.order.append(f"step {batch_idx}")

    def on_train_batch_end(self, *args: Any) -> None:
        self.order.append("batch end")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.order.append("validation")

    def on_train_start(self) -> None:
        self.undo = at_plateau_point(self.trainer, lambda: self.order.append("plateau point"))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_plateau_point_seam() -> None:
    """Lightning's loop steps its step-interval plateau schedulers after the batch's end hooks and validation,
    where the seam runs its function, once a batch."""
    model = PlateauPoint()
    t = trainer(max_epochs=1, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0)
    t.fit(model, loader(TokenData(12), 4), loader(TokenData(4), 4))
    batch = ["batch end", "plateau point"]
    assert model.order == [
        "step 0", *batch, "step 1", "batch end", "validation", "plateau point", "step 2", *batch,
    ]  # fmt: skip
    assert "update_lr_schedulers" in vars(t.fit_loop.epoch_loop)
    model.undo()
    assert "update_lr_schedulers" not in vars(t.fit_loop.epoch_loop)


def test_zero_grad_guard_seam() -> None:
    """A `LightningOptimizer`'s `zero_grad` is torch's method run on the wrapper, not the wrapped optimizer's
    attribute: the guard covers both, and gives back what was there."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    calls: list[str] = []
    optimizer = torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1)
    wrapper = LightningOptimizer(optimizer)
    optimizer.zero_grad = lambda *a, **k: calls.append("raw attribute")  # type: ignore[method-assign]
    wrapper.zero_grad()
    assert calls == []  # (Lightning's wrapper does not reach the optimizer's own attribute)
    own = optimizer.zero_grad
    undo = guard_zero_grad([wrapper], lambda: calls.append("checked"))
    wrapper.zero_grad()
    optimizer.zero_grad()
    assert calls == ["checked", "checked", "raw attribute"]
    undo()
    assert vars(optimizer)["zero_grad"] is own and "zero_grad" not in vars(wrapper)


def test_scheduler_keys_are_lightnings() -> None:
    import dataclasses

    from lightning.pytorch.utilities.types import LRSchedulerConfig

    fields = tuple(f.name for f in dataclasses.fields(LRSchedulerConfig))
    assert fields == SCHEDULER_KEYS
    assert set(DROPPED_SCHEDULER_KEYS) < set(SCHEDULER_KEYS)


class PassEndWatch(pl.Callback):
    """Listed before ``AccumulationScheduler``: whether, at each ``on_after_backward`` of its, the package's engine was
    told already that the batch's backward pass ended."""

    def __init__(self, accumulation: AccumulationScheduler) -> None:
        self.accumulation = accumulation
        self.seen: list[bool] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.seen.append(self.accumulation._engine.backward_finished)


def test_at_pass_end_seam() -> None:
    """``at_pass_end`` (private torch: the autograd engine's final callbacks): the mark comes once the pass's
    gradients are all in ``.grad``, before ``backward()`` returns, so before every ``on_after_backward`` (the first
    callback's included); a pass that raises never marks it."""
    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    marks: list[Any] = []
    loss = (weight * torch.arange(3.0, dtype=torch.float64)).sum() * 2
    loss.grad_fn.register_prehook(at_pass_end(lambda: marks.append(weight.grad.clone())))  # type: ignore[union-attr]
    loss.backward()
    marks.append("returned")
    assert len(marks) == 2 and marks[1] == "returned"
    assert torch.equal(marks[0], torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64))  # the whole gradient
    marks.clear()
    loss = (weight * 3).sum()
    loss.grad_fn.register_prehook(at_pass_end(lambda: marks.append("marked")))  # type: ignore[union-attr]
    weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("in the pass")))
    with pytest.raises(RuntimeError, match="in the pass"):
        loss.backward()
    assert marks == []
    accumulation = AccumulationScheduler(2)
    watch = PassEndWatch(accumulation)
    trainer(callbacks=[watch, accumulation], max_epochs=1).fit(TokenModel(), loader(TokenData(16), 4))
    assert watch.seen == [True] * 4


class Peeks(pl.Callback):
    """At each batch's start, the next ``ahead`` batches read through ``Upcoming`` (their first sample's first
    feature: which batch each is), and the batch itself."""

    def __init__(self, ahead: int = 3, save: tuple[int, Any] | None = None) -> None:
        self.ahead, self.save = ahead, save
        self.trained: list[list[float]] = []
        self.peeked: list[list[Any]] = []
        self.saved: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.upcoming = Upcoming(trainer)
        assert self.upcoming.usable()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.trained.append([])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.trained[-1].append(float(batch["x"][0, 0, 0]))
        peeks = [self.upcoming.batch(j) for j in range(1, self.ahead + 1)]
        self.peeked.append([None if b is ENDED else float(b["x"][0, 0, 0]) for b in peeks])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.save is not None and args[-1] == self.save[0]:
            self.saved = trainer.fit_loop.on_save_checkpoint().get("combined_loader")

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.upcoming.detach()


class Unsized(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The batches of ``loader(data, 4)``, with no length (Lightning's fetcher then takes one batch ahead itself)."""

    def __init__(self, data: TokenData) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(loader(self.data, 4))


@pytest.mark.parametrize("sized", [True, False])
def test_upcoming_batches_are_the_ones_trained_next(sized: bool) -> None:
    """``Upcoming`` (a ``Budget``'s counts, read ahead): the j-th batch after the one being trained, from the
    fetcher's own batches taken ahead (a loader without a length) and then from its iterator, handed over in
    order; ``ENDED`` past the epoch's data. The loop trains every batch once, in the loader's order."""
    data = TokenData(40)
    order = [float(b["x"][0, 0, 0]) for b in loader(data, 4)]
    source = loader(data, 4) if sized else torch.utils.data.DataLoader(Unsized(data), batch_size=None)
    peeks = Peeks()
    trainer(callbacks=[peeks], max_epochs=2).fit(TokenModel(), source)
    assert peeks.trained == [order, order]
    ahead = [[order[i + j] if i + j < len(order) else None for j in (1, 2, 3)] for i in range(len(order))]
    assert peeks.peeked == ahead * 2


class ProgressState(ResumableLoader):
    """A stateful loader whose state reads the loop's progress rather than moving as batches are taken."""

    trainer: Any = None

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}


@pytest.mark.parametrize("loader_kind", ["moves as taken", "reads the loop's progress"])
def test_a_stateful_loader_is_saved_as_without_reading_ahead(loader_kind: str) -> None:
    """Lightning saves a stateful loader's ``state_dict`` in a checkpoint (``CombinedLoader._state_dicts``): while
    batches read ahead are held, a loader whose state moves as batches are taken gives its state before the first of
    them (here 3 batches in, as a loop that read nothing ahead would save), one whose state does not gives its own."""
    saved = []
    for ahead in (0, 3):
        kind = ResumableLoader if loader_kind == "moves as taken" else ProgressState
        source = kind(TokenData(40), 4)
        peeks = Peeks(ahead=ahead, save=(2, None))
        t = trainer(callbacks=[peeks], max_epochs=1)
        ProgressState.trainer = t
        t.fit(TokenModel(), source)
        saved.append(peeks.saved)
    assert saved[0] == saved[1] == [{"consumed": 3}]
    combined = t.fit_loop._combined_loader
    assert combined is None or "_state_dicts" not in vars(combined)  # (given back at the fit's end)


class TakesTheIterator(TokenModel):
    def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


def test_a_loop_whose_training_step_takes_the_iterator_cannot_be_read_ahead() -> None:
    usable: list[bool] = []

    class Asks(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            usable.append(Upcoming(trainer).usable())

    trainer(callbacks=[Asks()], max_epochs=1, max_steps=1).fit(TakesTheIterator(), loader(TokenData(8), 4))
    assert usable == [False]
