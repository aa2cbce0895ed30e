"""Fault injection: an exception at each point of a window, resumed from the checkpoint Lightning left.

Each case runs a fit that fails once (an exception raised by another callback at one hook of a
window, by the model's ``training_step``, inside a backward pass, during a validation inside a
window, or a real SIGTERM), then a fit resumed from a checkpoint of the failed one, and
compares the final parameters with an uninterrupted fit: **bit-identical** (``torch.equal``).

Lightning trains a batch again after a resume when the exception came before the batch was
*processed* (before ``on_train_batch_end``), and does not when it came later. The loader here
resumes at the batches Lightning processed, as a loader must for that to work.

Where the exception leaves a partial gradient (inside a backward pass, inside the mixin's block
after a pass, or after the window's gradient was rescaled for its step), the on-exception
checkpoint cannot hold the window: the package warns and leaves it out, and the case resumes
from the last checkpoint saved at an optimizer step instead (also checked to be exact).
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_accum import AccumulationScheduler, Budget, GradientDecay, NoiseScale, Piecewise

from helpers import ManualTokenModel, ResumableLoader, TokenData, TokenModel, count_tokens, token_losses, trainer

DATA, VAL = TokenData(50), TokenData(8, seed=1)  # 13 training batches of 4 per epoch, the last of 2
WINDOWS = Piecewise({0: 3, 4: 2}, unit="step")  # windows [0-2] [3-5] [6-8] [9-11] [12], then of 2
MID, LAST = (0, 4), (0, 5)  # the second micro-batch of the window [3-5], and its last


class Injected(RuntimeError):
    pass


class ProcessedLoader(ResumableLoader):
    """Saves as consumed the batches Lightning processed: a batch cut short is yielded again."""

    trainer: pl.Trainer | None = None

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"consumed": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}


class Bind(pl.Callback):
    def __init__(self, data: ProcessedLoader) -> None:
        self.data = data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.data.trainer = trainer


class Fault(pl.Callback):
    """Raises once at ``hook`` of batch ``at`` (epoch, index); ``"sigterm"`` sends the process a real SIGTERM
    at the end of the batch; ``"in_backward"`` raises from inside the batch's backward pass."""

    def __init__(self, hook: str, at: tuple[int, int]) -> None:
        self.hook, self.at, self.fired = hook, at, False

    def _fire(self, trainer: pl.Trainer, hook: str, loss: torch.Tensor | None = None) -> None:
        here = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        if self.fired or hook != self.hook or here != self.at:
            return
        self.fired = True
        if hook == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif hook == "in_backward":
            assert loss is not None
            loss.register_hook(lambda grad: (_ for _ in ()).throw(Injected("in backward")))
        else:
            raise Injected(hook)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_train_batch_start")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self._fire(trainer, "on_before_backward")
        self._fire(trainer, "in_backward", loss)

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_train_batch_end")
        self._fire(trainer, "sigterm")

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "validation")


class Validated(TokenModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", token_losses(self.net, batch)[0], batch_size=4)


class BackwardFault(Validated):
    """``fault = at``: the model's own ``backward`` raises at batch ``at``, after ``loss.backward()`` returned (the
    batch's gradient whole in ``.grad``, no ``on_after_backward`` run yet)."""

    fault: tuple[int, int] | None = None

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().backward(loss, *args, **kwargs)
        if self.fault == (self.current_epoch, self.trainer.fit_loop.epoch_loop.batch_idx):
            self.fault = None
            raise Injected("after the model's loss.backward()")


class ManualValidated(ManualTokenModel):
    """The mixin's model, with faults its `training_step` can raise: before the block, inside it after
    the backward pass, or after it."""

    fault: tuple[str, tuple[int, int]] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> None:
        here = (self.current_epoch, batch_idx)
        where = None
        if self.fault is not None and self.fault[1] == here:
            where, self.fault = self.fault[0], None
        if where == "before_block":
            raise Injected(where)
        with self.accumulate(batch) as acc:
            total, tokens = token_losses(self.net, batch)
            acc.backward(total if self.reduction == "sum" else total / tokens)
            if where == "in_block":
                raise Injected(where)
        if where == "after_block":
            raise Injected(where)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", token_losses(self.net, batch)[0], batch_size=4)


class PieceFault(Validated):
    """Batches of 4 cut into pieces (`microbatch_size`); ``fault = (where, at)`` raises in the second piece of
    batch ``at``: in its forward (``"in_piece"``) or inside its backward (``"in_piece_backward"``). With
    ``fits``, a piece of more samples runs out of memory (injected) in its forward."""

    fault: tuple[str, tuple[int, int]] | None = None

    def __init__(self, fits: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fits, self.calls = fits, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fits is not None and len(batch["x"]) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        here = (self.current_epoch, batch_idx)
        where = None
        if self.fault is not None and self.fault[1] == here:
            self.calls += 1
            if self.calls == 2:
                where, self.fault = self.fault[0], None
        if where == "in_piece":
            raise Injected(where)
        loss = super().training_step(batch, batch_idx)
        if where == "in_piece_backward":
            loss.register_hook(lambda grad: (_ for _ in ()).throw(Injected("in a piece's backward")))
        return loss


class TokenBatchNorm(torch.nn.Module):
    """A ``BatchNorm1d`` over every token's features (tokens along the length: ``(N, C, T)``)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(features, momentum=None)  # (the cumulative average: every window counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return out


class BatchNormPieceFault(PieceFault):
    """``PieceFault`` whose net normalises its hidden features with BatchNorm (``batchnorm="window"``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, 8), TokenBatchNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        ).double()


def setups(kind: str) -> tuple[pl.LightningModule, list[pl.Callback]]:
    """A fresh model and accumulation callbacks: `mean`, `items` with GradientDecay, or NoiseScale; `split`
    (pieces of 3 of batches of 4), `split+auto` (out of memory above 2 samples) with GradientDecay."""
    if kind == "split":
        return PieceFault(), [AccumulationScheduler(WINDOWS, microbatch_size=3)]
    if kind == "split+batchnorm":
        return BatchNormPieceFault(), [AccumulationScheduler(WINDOWS, microbatch_size=3, batchnorm="window")]
    if kind == "batchnorm":  # (whole batches)
        return BatchNormPieceFault(), [AccumulationScheduler(WINDOWS, batchnorm="window")]
    if kind == "split+noise":
        return PieceFault(), [AccumulationScheduler(NoiseScale(2, 4, every=1, warmup=1), microbatch_size=3)]
    if kind == "split+auto":
        callback = AccumulationScheduler(WINDOWS, normalize="items", reduction="sum", count=count_tokens,
                                         microbatch_size="auto")  # fmt: skip
        return PieceFault(fits=2, reduction="sum"), [callback, GradientDecay(0.5)]
    if kind == "mean":
        return Validated(), [AccumulationScheduler(WINDOWS)]
    if kind == "mean+backward":  # (the model's `backward` may raise: `BackwardFault`)
        return BackwardFault(), [AccumulationScheduler(WINDOWS)]
    if kind == "items+decay":
        callback = AccumulationScheduler(WINDOWS, normalize="items", reduction="sum", count=count_tokens)
        return Validated(reduction="sum"), [callback, GradientDecay(0.5)]
    if kind == "noise":
        return Validated(), [AccumulationScheduler(NoiseScale(2, 4, every=1, warmup=1))]
    if kind == "budget":  # (windows closed by 25 tokens: `tests/test_budget.py`)
        callback = AccumulationScheduler(Budget(25), normalize="items", reduction="sum", count=count_tokens)
        return Validated(reduction="sum"), [callback]
    if kind == "mixin":
        return ManualValidated(schedule=WINDOWS), []
    if kind == "mixin+budget":  # (issue 52: each block's count over ranks read at its end)
        return ManualValidated(schedule=Budget(25), normalize="items", count=count_tokens, reduction="sum"), []
    if kind == "mixin+budget+ahead":  # (its counts read ahead from the loader: `tests/test_read_ahead.py`)
        return ManualValidated(schedule=Budget(25), normalize="items", count=count_tokens, reduction="sum",
                               read_ahead=True), []  # fmt: skip
    if kind == "mixin+decay":
        return ManualValidated(schedule=WINDOWS, normalize="items", count=count_tokens, reduction="sum",
                               reset=GradientDecay(0.5)), []  # fmt: skip
    return ManualValidated(schedule=NoiseScale(2, 4, every=1, warmup=1)), []


def fit(kind: str, tmp: Path | None = None, fault: Any = None, resume: Path | None = None) -> pl.LightningModule:
    model, callbacks = setups(kind)
    data = ProcessedLoader(DATA, 4)
    callbacks = [*callbacks, Bind(data)]
    if tmp is not None:
        callbacks += [ModelCheckpoint(tmp, "{step}", every_n_train_steps=1, save_top_k=-1), OnExceptionCheckpoint(tmp)]
    if isinstance(fault, Fault):
        callbacks.insert(0 if fault.hook.endswith(":before") else len(callbacks), fault)
        fault.hook = fault.hook.removesuffix(":before")
    elif fault is not None:
        model.fault = fault  # type: ignore[assignment]
    saves = tmp is not None
    t = trainer(
        callbacks=callbacks, max_epochs=2, val_check_interval=5, limit_val_batches=1, enable_checkpointing=saves
    )
    t.fit(model, data, ResumableLoader(VAL, 4), ckpt_path=resume)
    schedule = callbacks[0].schedule if isinstance(callbacks[0], AccumulationScheduler) else None
    model.schedule_state = (schedule or model._accumulation.config.schedule).state_dict()  # type: ignore[union-attr]
    return model


UNINTERRUPTED: dict[str, pl.LightningModule] = {}


def uninterrupted(kind: str) -> pl.LightningModule:
    if kind not in UNINTERRUPTED:
        UNINTERRUPTED[kind] = fit(kind)
    return UNINTERRUPTED[kind]


def fail_and_resume(kind: str, tmp: Path, fault: Any, source: str) -> list[str]:
    """Fit until the fault, resume from ``source`` ("exception" or "step"), compare; the warnings seen."""
    uninterrupted(kind)  # (first: its warnings are not the interrupted run's)
    with warnings.catch_warnings(record=True) as seen, pytest.raises((Injected, SystemExit)):
        warnings.simplefilter("always")
        fit(kind, tmp, fault)
    path = tmp / "on_exception.ckpt"
    if source == "step":
        steps = sorted(tmp.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
        path = steps[-1]
    assert path.exists()
    resumed = fit(kind, resume=path)
    full = uninterrupted(kind)
    for got, want in zip(resumed.parameters(), full.parameters(), strict=True):
        assert torch.equal(got.detach(), want.detach()), kind
    assert resumed.schedule_state == full.schedule_state  # NoiseScale: its estimator bit for bit too
    return [str(w.message) for w in seen if "accumulation window" in str(w.message)]


CALLBACK_FAULTS = [  # (hook, batch, resume from, whether the package warns that the window is left out)
    ("on_train_batch_start", MID, "exception", False),
    ("on_before_backward", MID, "exception", False),
    ("on_after_backward", MID, "exception", False),
    # a callback before the package's: the batch's gradient is in `.grad`, the package's own hook has not run (before
    # the fix the batch was taken back, then trained again and added twice)
    ("on_after_backward:before", MID, "exception", False),
    ("on_before_optimizer_step:before", LAST, "exception", False),  # before the package's rescale
    ("on_train_batch_end:before", LAST, "exception", False),  # the window was stepped: the batch counts as done
    ("on_train_batch_end", MID, "exception", False),
    ("validation", (0, 4), "exception", False),  # validation after batch 4, inside the window [3-5]
    ("sigterm", MID, "exception", False),
    ("on_before_optimizer_step", LAST, "step", True),  # after the rescale: left out, with a warning
    ("in_backward", MID, "step", True),  # a partial gradient: left out, with a warning
]


@pytest.mark.parametrize("kind", ["mean", "items+decay", "noise"])
@pytest.mark.parametrize(("hook", "at", "source", "warns"), CALLBACK_FAULTS)
def test_callback_fault(tmp_path: Path, kind: str, hook: str, at: tuple[int, int], source: str, warns: bool) -> None:
    seen = fail_and_resume(kind, tmp_path, Fault(hook, at), source)
    assert bool(seen) == warns, seen


@pytest.mark.parametrize("at", [MID, LAST, (0, 3)])  # inside a window, at its last batch, at its first
def test_model_backward_fault(tmp_path: Path, at: tuple[int, int]) -> None:
    """The model's ``backward`` raises after its ``loss.backward()`` (the pass ended; no ``on_after_backward`` ran):
    the batch is in the window, and trained again it adds nothing (before the fix it was added twice)."""
    assert not fail_and_resume("mean+backward", tmp_path, at, "exception")


MIXIN_FAULTS = [
    (("before_block", MID), "exception", False),
    (("after_block", MID), "exception", False),  # the batch's gradient is in the window: trained again, adds 0
    (Fault("on_before_optimizer_step", LAST), "exception", False),  # before the driver's rescale
    # a callback's hooks inside `acc.backward` (Lightning's `manual_backward`): inside the block, once a pass began
    (Fault("on_before_backward", MID), "step", True),
    (Fault("on_after_backward:before", MID), "step", True),
    (Fault("on_train_batch_end", LAST), "exception", False),
    (Fault("validation", (0, 4)), "exception", False),
    (Fault("sigterm", MID), "exception", False),
    (("in_block", MID), "step", True),  # inside the block after a pass: left out, with a warning
    (("after_block", LAST), "step", True),  # the window was stepped, and Lightning trains the batch again
]


@pytest.mark.parametrize("kind", ["mixin", "mixin+decay", "mixin+noise"])
@pytest.mark.parametrize(("fault", "source", "warns"), MIXIN_FAULTS, ids=lambda v: getattr(v, "hook", str(v)))
def test_mixin_fault(tmp_path: Path, kind: str, fault: Any, source: str, warns: bool) -> None:
    fault = Fault(fault.hook, fault.at) if isinstance(fault, Fault) else fault  # a fresh one per case
    if kind == "mixin+noise" and warns and (fault.at if isinstance(fault, Fault) else fault[1]) == MID:
        warns = False  # NoiseScale's windows of 2 start at batch 4: nothing of the window is lost, nothing to warn of
    seen = fail_and_resume(kind, tmp_path, fault, source)
    assert bool(seen) == warns, seen


SPLIT_FAULTS = [  # as CALLBACK_FAULTS, where a loader batch is cut into pieces
    ("in_piece", MID, "exception", False),  # the first piece is in: the resumed run trains the rest of the batch
    ("in_piece", (0, 3), "exception", False),  # the same at a window's first batch, which Lightning zeroes
    ("on_before_backward:before", MID, "exception", False),  # every piece is in, the batch not yet counted
    ("on_before_backward", MID, "exception", False),  # counted: trained again, it adds nothing
    ("in_backward", MID, "exception", False),  # Lightning's backward reaches no parameter: nothing partial
    ("on_after_backward", MID, "exception", False),
    ("on_after_backward:before", MID, "exception", False),  # (the batch counted in `on_before_backward` already)
    ("on_before_optimizer_step:before", LAST, "exception", False),
    ("on_train_batch_end", MID, "exception", False),
    ("validation", (0, 4), "exception", False),
    ("sigterm", MID, "exception", False),
    ("on_before_optimizer_step", LAST, "step", True),  # after the rescale: left out, with a warning
    ("in_piece_backward", MID, "step", True),  # part of a piece's gradient: left out, with a warning
]


@pytest.mark.parametrize("kind", ["split", "split+auto", "split+noise"])
@pytest.mark.parametrize(("hook", "at", "source", "warns"), SPLIT_FAULTS)
def test_split_fault(tmp_path: Path, kind: str, hook: str, at: tuple[int, int], source: str, warns: bool) -> None:
    """An exception anywhere in a batch cut into pieces, a piece's forward included, loses nothing. With a
    ``NoiseScale`` (windows of 2: batch 4 opens one), the noise probe's prefix after the failed batch is kept with its
    gradient: before the fix, a failure in ``on_before_backward`` (the batch counted, trained again adding nothing)
    lost it, and the window measured nothing."""
    fault = (hook, at) if hook.startswith("in_piece") else Fault(hook, at)
    if kind == "split+noise" and hook == "in_piece_backward":
        warns = False  # (the window's first batch: nothing of the window is lost, nothing to warn of)
    seen = fail_and_resume(kind, tmp_path, fault, source)
    assert bool(seen) == warns, seen


@pytest.mark.parametrize(
    ("hook", "at"),
    [("in_piece", MID), ("in_piece", (0, 3)), ("on_before_backward:before", MID), ("on_after_backward", MID)],
)
def test_split_fault_batchnorm_statistics(tmp_path: Path, hook: str, at: tuple[int, int]) -> None:
    """``batchnorm="window"``: where an exception between pieces keeps the finished pieces in the window's gradient
    (the checkpoint holds them, the resumed run trains the rest of the batch), their BatchNorm statistics are in the
    window too: the resumed run ends with the uninterrupted run's running statistics, as with its parameters."""
    fault = (hook, at) if hook.startswith("in_piece") else Fault(hook, at)
    assert not fail_and_resume("split+batchnorm", tmp_path, fault, "exception")
    resumed = fit("split+batchnorm", resume=tmp_path / "on_exception.ckpt")
    full = uninterrupted("split+batchnorm")
    for name, want in full.net.named_buffers():
        got = dict(resumed.net.named_buffers())[name]
        assert float((got.double() - want.double()).abs().max()) <= 1e-12, name
    assert int(full.net[1].bn.num_batches_tracked) == 5 + 7  # a window each: [0-2] [3-5] [6-8] [9-11] [12], 7 of 2


@pytest.mark.parametrize("hook", ["on_after_backward:before", "on_after_backward", "on_before_backward"])
def test_fault_batchnorm_statistics_whole_batches(tmp_path: Path, hook: str) -> None:
    """``batchnorm="window"`` on whole batches: a batch whose backward pass ended is in the window with its BatchNorm
    statistics, also where a callback before the package's raised in ``on_after_backward`` (the package's own hook,
    which pools them, had not run); one whose pass never ran is in neither."""
    assert not fail_and_resume("batchnorm", tmp_path, Fault(hook, MID), "exception")
    resumed = fit("batchnorm", resume=tmp_path / "on_exception.ckpt")
    full = uninterrupted("batchnorm")
    for name, want in full.net.named_buffers():
        got = dict(resumed.net.named_buffers())[name]
        assert float((got.double() - want.double()).abs().max()) <= 1e-12, name


class RaisesIn(torch.autograd.Function):
    """An autograd function that raises ``Injected`` in its ``forward`` or its ``backward`` (``where``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.where = where
        if where == "forward":
            raise Injected("in forward")
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise Injected("in backward")


def test_only_an_error_raised_while_autograd_runs_backward_is_inside_a_backward_pass() -> None:
    """(What decides whether an exception may have left a partial gradient.) An error in an autograd function's
    forward, whose frames are autograd's own too, is not inside a backward pass; one in its backward is."""
    from lightning_accum._trainer.recovery import raised_in_backward

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(Injected) as forward:
        RaisesIn.apply(x, "forward")
    assert not raised_in_backward(forward.value)
    with pytest.raises(Injected) as backward:
        RaisesIn.apply(x, "backward").sum().backward()
    assert raised_in_backward(backward.value)
    with pytest.raises(Injected) as plain:
        raise Injected("elsewhere")
    assert not raised_in_backward(plain.value)


class SkipsLastBatch(ManualTokenModel):
    """Runs no ``accumulate`` block in each epoch's last batch (13 of 4 samples and one of 2 here): the window it
    would have ended is stepped at the epoch's end, outside a block."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx < 12:
            super().training_step(batch, batch_idx)


class RaisesAtTheLastBatch(pl.Callback):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def _raise(self, trainer: pl.Trainer) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == 12:
            raise Injected(self.hook)

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "on_before_optimizer_step":
            self._raise(trainer)

    def on_window_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "on_window_end":
            self._raise(trainer)


@pytest.mark.parametrize(("hook", "lost"), [("on_before_optimizer_step", 2), ("on_window_end", None)])
def test_an_exception_while_the_epochs_end_steps_a_window_outside_a_block(hook: str, lost: int | None) -> None:
    """The mixin steps a window its epoch's last batch ran no block of at the epoch's end. An exception before that
    step leaves the window's micro-batches (k = 5: batches 10 and 11, by hand) out of a checkpoint written then,
    and says so; one after the step leaves nothing out and says nothing."""
    model = SkipsLastBatch(schedule=5)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Injected):
        warnings.simplefilter("always")
        trainer(callbacks=[RaisesAtTheLastBatch(hook)], max_epochs=1).fit(model, ResumableLoader(DATA, 4))
    said = [str(w.message) for w in caught if "An exception came while" in str(w.message)]
    if lost is None:
        assert said == []
    else:
        assert len(said) == 1
        assert f"stepped at the epoch's end: a checkpoint written now leaves its {lost} micro-batch(es) out" in said[0]
