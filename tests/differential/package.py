"""The package under test: a ``Config`` run through Lightning with ``AccumulationScheduler`` or
``AccumulationMixin``, interrupted and resumed where the configuration says."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    Checkpoint,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    ProgressBar,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

import lightning_accum as la
from lightning_accum._core import ahead
from lightning_accum.lr import WarmupCosine

from .configs import NOISE_OPTIONS, Config
from .model import Data, batch_probe, count_tokens, errors, guide_weights, make_net, micro_loss, probe_loss
from .reference import EMA, Result, make_optimizers, make_scheduler, optimizer_state

LAMBDA_FNS = {
    "cycle3": lambda p: 1 + p.step % 3,
    "epoch_up": lambda p: 1 + min(p.epoch, 3),
    "samples_tier": lambda p: 2 if p.samples < 30 else 3,
}


class Injected(RuntimeError):
    pass


class Interrupted(RuntimeError):
    """A clean stop after a checkpoint was saved."""


def schedule(spec: dict[str, Any]) -> la.Schedule:
    family = spec["family"]
    if family == "constant":
        return la.Constant(spec["k"])
    if family == "piecewise":
        return la.Piecewise([tuple(m) for m in spec["milestones"]], unit=spec["unit"])
    if family == "ramp":
        return la.Ramp(spec["start"], spec["end"], over=spec["over"], unit=spec["unit"])
    if family == "noise":  # `NoiseScale` (issue 42): its arguments as drawn (`configs._noise`)
        options = {key: spec[key] for key in NOISE_OPTIONS if key in spec}
        return la.NoiseScale(spec["min_k"], spec["max_k"], **options)
    if family == "budget":  # (issue 46) `n` an int or a schedule spec of its own
        n = spec["n"] if isinstance(spec["n"], int) else schedule(spec["n"])
        return la.Budget(n, unit=spec["unit"], max_k=spec.get("max_k"))
    return la.Lambda(LAMBDA_FNS[spec["fn"]])


def lr_schedule(c: Config) -> Any:
    s = c.lr_schedule
    return None if s is None else WarmupCosine(s["warmup"], s["total"], unit=s["unit"], final=s["final"])


def package_callbacks(c: Config) -> list[pl.Callback]:
    """The package's callbacks of a callback configuration (none for the mixin)."""
    callbacks: list[pl.Callback] = []
    if c.adapter == "callback" and not c.plain:
        callbacks.append(
            la.AccumulationScheduler(
                schedule(c.schedule),
                normalize=c.normalize,  # type: ignore[arg-type]
                count=(count_or_positions if c.mutate else count_tokens) if c.count else None,
                reduction=c.reduction if c.normalize == "items" else None,  # type: ignore[arg-type]
                lr_scaling=c.lr_scaling,  # type: ignore[arg-type]
                lr_schedule=lr_schedule(c),
                microbatch_size=c.microbatch_size,
                **batchnorm(c),
                **wide(c),
            )
        )
    if c.adapter == "callback" and c.decay is not None:
        callbacks.append(decay(c))  # type: ignore[arg-type]
    return callbacks


def batchnorm(c: Config) -> dict[str, Any]:
    """The adapter's ``batchnorm=`` where the net has a BatchNorm layer (issue 44)."""
    return {} if c.batchnorm is None else {"batchnorm": c.batchnorm}


def wide(c: Config) -> dict[str, Any]:
    """The adapter's ``grad_accum_dtype=`` where it is drawn (issue 51)."""
    return {} if c.grad_accum_dtype is None else {"grad_accum_dtype": c.grad_accum_dtype}


def grads_of(optimizer: Any) -> list[Tensor | None]:
    """The gradient of each of an optimizer's parameters (in its param groups' order), copied; None where none."""
    raw = getattr(optimizer, "optimizer", optimizer)
    return [None if p.grad is None else p.grad.detach().clone() for g in raw.param_groups for p in g["params"]]


def count_or_positions(batch: dict[str, Tensor]) -> Tensor:
    """The mask's items, or where `training_step` took the mask out already every position (as
    `causal_lm_tokens` falls back to the attention mask without labels): right only if taken first."""
    if "mask" in batch:
        return count_tokens(batch)
    return torch.tensor(float(batch["x"].shape[0] * batch["x"].shape[1]), dtype=torch.float64)


def decay(c: Config) -> la.GradientDecay | None:
    return None if c.decay is None else la.GradientDecay(c.decay[0], mode=c.decay[1], bias_correction=c.decay[2])


class Shared:
    """An object the module holds that a copy of the module shares (SWA's `deepcopy`)."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


class SilentBar(ProgressBar):
    """A progress bar that draws nothing: a reader of every window's ``k`` and loss (``reporting.Readers``)."""

    def disable(self) -> None: ...

    def enable(self) -> None: ...


def monitored(c: Config) -> str:
    """What EarlyStopping and ReduceLROnPlateau watch: the probe, or the (first optimizer's) window loss."""
    return "accum/opt0/loss" if c.monitor == "accum/loss" and c.windows == "each" else c.monitor


class _Base(pl.LightningModule):
    def __init__(self, c: Config, data: Data) -> None:
        super().__init__()
        self.c, self.data = c, data
        self.net = make_net(c.seed, c)
        self.joined = False  # (`unfreeze`: whether the first layer joined the first optimizer)
        if c.unfreeze is not None:  # (frozen, and outside the optimizer, until `on_train_batch_start` of its batch)
            self.net[0].requires_grad_(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.c.unfreeze is not None and not self.joined and [self.current_epoch, batch_idx] == list(self.c.unfreeze):
            self.joined = True  # (as `BaseFinetuning.unfreeze_and_add_param_group` does)
            self.net[0].requires_grad_(True)
            optimizer = self.optimizers()
            first = optimizer[0] if isinstance(optimizer, list) else optimizer
            first.optimizer.add_param_group({"params": list(self.net[0].parameters())})  # type: ignore[union-attr]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written after the join holds the first optimizer with the group (as `BaseFinetuning` keeps
        its groups' record): the optimizers are made with it (`configure_optimizers`) before their state is loaded."""
        if self.c.unfreeze is not None:
            self.joined = len(checkpoint["optimizer_states"][0]["param_groups"]) > 1

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val", micro_loss(self.net, batch)[0], batch_size=len(batch["x"]))

    def clip_gradients(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's (the callback's clipping, and the mixin's), the gradient the step gets noted first, before
        clipping (`Recorder`)."""
        recorder = getattr(self, "recorder", None)
        if recorder is not None:
            recorder.it.before_clipping(optimizer)
        super().clip_gradients(optimizer, *args, **kwargs)

    def configure_optimizers(self) -> Any:
        if self.c.estimate:  # (sets the training loader up: a resumed epoch must still continue where it stopped)
            self.estimated = la.estimated_stepping_batches(self.trainer)
        opts = make_optimizers(self.c, self.net)
        if self.joined:  # (resumed after the join: the group given back before Lightning loads the optimizer's state)
            self.net[0].requires_grad_(True)
            opts[0].add_param_group({"params": list(self.net[0].parameters())})
        sched = make_scheduler(self.c, opts[0])
        if sched is None:
            return opts
        config = {"scheduler": sched, "interval": self.c.scheduler.get("interval", "epoch")}  # type: ignore[union-attr]
        if self.c.step_plateau():  # (on a metric logged after the batch: Lightning steps it after that)
            config["monitor"], config["strict"] = "batch", True
        elif self.c.scheduler["kind"] == "plateau":  # type: ignore[index]
            config["monitor"] = monitored(self.c)
            config["strict"] = self.c.monitor == "probe"  # (no window may have stepped by the first epoch's end)
        return opts, [config]

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        if self.c.step_plateau():
            self.log("batch", batch_probe(self.net, batch))

    def on_train_epoch_end(self) -> None:
        if self.c.probe_in == "module":  # (the usual place for an epoch's metric: after the callbacks')
            self.log("probe", probe_loss(self.net, self.data))

    def maybe_fail(self) -> None:
        fault = getattr(self, "fault", None)
        if fault is not None and fault.armed("training_step", self.trainer):
            raise Injected("training_step")


class Automatic(_Base):
    def __init__(self, c: Config, data: Data) -> None:
        super().__init__(c, data)
        self.calls: dict[tuple[int, int], int] = {}  # `training_step` calls per batch (one per piece)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        here = (self.current_epoch, batch_idx)
        self.calls[here] = self.calls.get(here, 0) + 1
        if self.calls[here] - 1 == self.c.fail_piece:  # (with `microbatch_size`, a later piece of the batch)
            self.maybe_fail()
        if batch_idx in self.c.skip:
            if self.c.skip_forward:  # (its forward ran in training mode: under "window" its statistics count)
                self.net(batch["x"])
            return None  # (Lightning runs no backward pass for the batch)
        over = self.c.oom is not None and len(batch["x"]) > self.c.oom[0]
        if over and self.c.oom[1] == "forward":  # type: ignore[index]
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if self.c.mutate:  # (`labels = batch.pop("labels")`: the batch's count must have been taken before)
            mask = batch.pop("mask")
            batch = {**batch, "mask": mask}
        hidden = self.net[0](batch["x"])
        if over:  # in backward, after the last layer's gradient is in: part of the piece's gradient is left
            if not hidden.requires_grad:  # (the first layer frozen, `unfreeze`: a leaf of its own, times exactly 1)
                hidden = hidden * torch.ones((), dtype=hidden.dtype, requires_grad=True)
            hidden.register_hook(_out_of_memory)
        total = errors(self.net[2](self.net[1](hidden)), batch).sum()
        positions = batch["x"].shape[0] * batch["x"].shape[1]
        if self.c.normalize == "mean":
            return total / positions
        return total / batch["mask"].sum() if self.c.reduction == "mean" else total


def _out_of_memory(grad: Tensor) -> Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


class Manual(la.AccumulationMixin, _Base):
    def __init__(self, c: Config, data: Data) -> None:
        super().__init__(c, data)
        self.guide = make_net(c.seed + 1) if c.guide and c.mode == "cached" else None  # (the cached mode's guide)
        if c.guide == "frozen" and self.guide is not None:
            self.guide.requires_grad_(False)
        self.configure_accumulation(
            schedule(c.schedule),
            normalize=c.normalize,  # type: ignore[arg-type]
            count=count_tokens if c.count else None,
            reduction=c.reduction if c.normalize == "items" else None,  # type: ignore[arg-type]
            reset=decay(c) or "zero",
            gradient_clip_val=None if c.clip is None else c.clip[0],
            gradient_clip_algorithm="norm" if c.clip is None else c.clip[1],
            lr_scaling=c.lr_scaling,  # type: ignore[arg-type]
            lr_schedule=lr_schedule(c),
            step_schedulers=c.schedulers_by != "user",  # ("both": the model steps it too, which is refused)
            read_ahead=c.read_ahead,
            **batchnorm(c),
            **wide(c),
        )

    @property
    def steps_scheduler(self) -> bool:
        """Whether the model steps its scheduler itself (Lightning's manual-optimization contract)."""
        return self.c.scheduler is not None and self.c.schedulers_by != "package"

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        if self.steps_scheduler and self.c.scheduler.get("interval", "epoch") == "epoch":  # type: ignore[union-attr]
            scheduler = self.lr_schedulers()
            if self.c.scheduler["kind"] != "plateau":  # type: ignore[index]
                scheduler.step()  # type: ignore[union-attr]
            elif (metric := self.trainer.callback_metrics.get(monitored(self.c))) is not None:
                scheduler.step(metric)  # type: ignore[union-attr]

    def _parts(self, out: Tensor, batch: dict[str, Tensor]) -> list[Tensor]:
        err = errors(out, batch)
        parts = [err[:, :2].sum(), err[:, 2:].sum()]
        if self.c.normalize == "mean":
            return [x / err.numel() for x in parts]
        if self._by_reduction():  # each a part of the micro-batch's token mean (NaN without tokens)
            return [x / batch["mask"].sum() for x in parts]
        return parts

    def _by_reduction(self) -> bool:
        """The mixin's ``reduction="mean"`` weighs the losses: each is a mean over the micro-batch's tokens."""
        return self.c.normalize == "items" and self.c.reduction == "mean" and self.c.mean_by == "reduction"

    def encode(self, tokens: Tensor, attention_mask: Tensor | None = None, width: int = 0) -> dict[str, Tensor]:
        """A keyword-argument encoder returning an output object, as a transformers model does (a chunk whose
        padding `chunk_tokens` trimmed comes back to ``width`` tokens, the trimmed ones zero: masked out)."""
        out = self.net(tokens)
        if out.shape[1] < width:
            out = torch.cat([out, out.new_zeros(len(out), width - out.shape[1], out.shape[2])], dim=1)
        return {"hidden": out}

    def _whole(self, batch: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        """The micro-batch's loss as `training_step` of the callback's model returns it (not `mean` over items)."""
        err = errors(self.net(batch["x"]) if out is None else out, batch)
        if self._by_reduction():  # the part's own token mean, weighted by `count(part)`
            return err.sum() / batch["mask"].sum()
        return err.sum() / err.numel() if self.c.normalize == "mean" else err.sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.maybe_fail()
        if self.c.zero_grad:  # (left over from Lightning's manual optimization: refused)
            optimizers = self.optimizers()
            (optimizers[0] if isinstance(optimizers, list) else optimizers).zero_grad()  # type: ignore[union-attr]
        if batch_idx in self.c.skip and self.c.skip_forward:  # a block whose forward ran, with no backward pass
            with self.accumulate(batch) as acc:
                self.net(batch["x"])
            if self.steps_scheduler and self.c.scheduler.get("interval") == "step" and acc.last:  # type: ignore[union-attr]
                self.lr_schedulers().step()  # type: ignore[union-attr]
            return None
        if batch_idx in self.c.skip:
            return None  # (Lightning's manual optimization: the batch trains nothing)
        if self.c.windows == "each":  # a window per optimizer, one after the other (a GAN's habit)
            for i, optimizer in enumerate(self.optimizers()):  # type: ignore[arg-type]
                self.toggle_optimizer(optimizer)  # (the pass reaches this optimizer's parameters only)
                with self.accumulate(batch, optimizer=i) as acc:
                    self._backward(acc, batch)
                self.untoggle_optimizer(optimizer)
        else:
            with self.accumulate(batch) as acc:
                self._backward(acc, batch)
        if self.steps_scheduler and self.c.scheduler.get("interval") == "step" and acc.last:  # type: ignore[union-attr]
            self.lr_schedulers().step()  # type: ignore[union-attr]
        return None

    def _backward(self, acc: Any, batch: dict[str, Tensor]) -> None:
        c, n = self.c, batch["mask"].sum()
        mean_items = c.normalize == "items" and c.reduction == "mean"
        if c.mode in ("backward", "items_int"):
            total, _, positions = micro_loss(self.net, batch)
            if c.normalize == "mean":
                acc.backward(total / positions)
            elif self._by_reduction():
                acc.backward(total / n)
            elif mean_items:
                acc.backward(total / n, items=int(n) if c.mode == "items_int" else n)
            else:
                acc.backward(total)
        elif c.mode == "microbatches":  # split in parts of 2 samples
            acc.backward_microbatches(lambda part: self._whole(part), size=2)
        elif c.mode == "cached":  # two towers of different sizes: the first two tokens of each sample, the
            # others one by one (per-token outputs, picked from an output object), then the loss on all of them
            # (in blocks of samples with `loss_chunk`); with `guide`, its weight on each token's error
            x, mask = batch["x"], batch["mask"]
            first, rest = {"tokens": x[:, :2]}, {"tokens": x[:, 2:].reshape(-1, 1, x.shape[-1])}
            if c.chunk_tokens is not None:
                first["attention_mask"], rest["attention_mask"] = mask[:, :2], mask[:, 2:].reshape(-1, 1)

            def loss(a: Tensor, b: Tensor, g: Tensor | None = None, rows: slice | None = None) -> Tensor:
                out = torch.cat([a, b.reshape(len(x), -1, b.shape[-1])], dim=1)
                some = slice(None) if rows is None else rows
                err = errors(out[some], {"y": batch["y"][some], "mask": mask[some]})
                if g is not None:
                    err = err * guide_weights(g)[some]
                if self._by_reduction():  # (its rows' part of the batch's token mean)
                    return err.sum() / mask.sum()
                return err.sum() / (len(x) * out.shape[1]) if c.normalize == "mean" else err.sum()

            encoders: list[Any] = [partial(self.encode, width=2), partial(self.encode, width=1)]
            inputs: list[Any] = [first, rest]
            if self.guide is not None:
                encoders.append(self.guide)
                inputs.append(x)
            acc.backward_cached(
                encoders, inputs, loss, chunk_size=c.chunks + [3] * (len(inputs) - 2),
                get_rep=[lambda out: out["hidden"]] * 2 + [None] * (len(inputs) - 2), loss_chunk_size=c.loss_chunk,
                chunk_tokens=None if c.chunk_tokens is None else c.chunk_tokens + [None] * (len(inputs) - 2),
                no_grad=[False, False] + [c.guide == "no_grad"] * (len(inputs) - 2),
            )  # fmt: skip
        elif c.mode == "each":
            acc.backward_each([lambda i=i: self._parts(self.net(batch["x"]), batch)[i] for i in (0, 1)])
        else:
            trunk, last = self.net[:2], self.net[2]
            acc.backward_heads(trunk(batch["x"]), [lambda f, i=i: self._parts(last(f), batch)[i] for i in (0, 1)])


class ResumingLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """Resumes mid-epoch at the batches Lightning processed (a batch cut short is yielded again)."""

    trainer: pl.Trainer | None = None

    def __init__(self, data: Data, batch_size: int) -> None:
        super().__init__(data, batch_size=batch_size, shuffle=False)
        self._skip = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        skip, self._skip = self._skip, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        t = self.trainer
        return {"consumed": t.fit_loop.epoch_loop.batch_progress.current.processed, "of": int(t.num_training_batches)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["consumed"] if state["consumed"] < state["of"] else 0  # a finished epoch starts anew


class Recorder(pl.Callback):
    """The LR of each optimizer step that moved something (keyed on the step, so that a resumed
    run overwrites what it trains again), the probe logged at each epoch's end, the loader bound."""

    def __init__(self, data: Data, loader: ResumingLoader, grads: bool = False) -> None:
        self.data, self.loader = data, loader
        self.lrs: dict[int, list[float]] = {}
        # under bf16: each step's gradient as the step got it, before clipping (`grads_of`), keyed as the LRs
        self.grads: dict[int, list[Tensor | None]] | None = {} if grads else None
        self._clipped: dict[int, list[Tensor | None]] = {}  # noted before clipping, by optimizer
        self._hooks: list[Any] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loader.trainer = trainer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for opt in trainer.optimizers:
            self._hooks.append(opt.register_step_post_hook(lambda o, *_, t=trainer: self._record(o, t)))

    def _record(self, opt: torch.optim.Optimizer, trainer: pl.Trainer) -> None:
        before = self._clipped.pop(id(opt), None)
        if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
            self.lrs[trainer.global_step] = [g["lr"] for g in opt.param_groups]
            if self.grads is not None:  # (the optimizers change no `.grad`: after the step is as before it)
                self.grads[trainer.global_step] = grads_of(opt) if before is None else before

    def before_clipping(self, optimizer: Any) -> None:
        if self.grads is not None:
            self._clipped[id(getattr(optimizer, "optimizer", optimizer))] = grads_of(optimizer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.c.probe_in == "callback":  # type: ignore[union-attr]
            pl_module.log("probe", probe_loss(pl_module.net, self.data))  # type: ignore[arg-type]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class WindowEMA(pl.Callback):
    """A user's average of the parameters at each window's end (``on_window_end``), kept in checkpoints."""

    def __init__(self) -> None:
        self.average: list[Tensor] | None = None

    def on_window_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: la.WindowReport) -> None:
        now = [p.detach().clone() for p in pl_module.net.parameters()]  # type: ignore[union-attr]
        self.average = now if self.average is None else [
            EMA * a + (1 - EMA) * b for a, b in zip(self.average, now, strict=True)]  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.average = state_dict["average"]


class Interrupter(Checkpoint):
    """Saves a checkpoint and stops (``"save"``), or fails once at a hook of one batch. A
    ``Checkpoint`` so that Lightning runs it where it runs ``ModelCheckpoint``: after the others."""

    def __init__(self, kind: str, epoch: int, batch: int, path: Path) -> None:
        self.kind, self.at, self.path, self.fired = kind, (epoch, batch), path, False

    def armed(self, hook: str, trainer: pl.Trainer) -> bool:
        here = (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        if self.fired or hook != self.kind or here != self.at:
            return False
        self.fired = True
        return True

    def _fire(self, trainer: pl.Trainer, hook: str) -> None:
        if self.armed(hook, trainer):
            raise Injected(hook)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_train_batch_start")

    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_before_backward")

    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_before_optimizer_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "on_train_batch_end")
        if self.armed("save", trainer):
            trainer.save_checkpoint(self.path)
            raise Interrupted()
        if self.armed("sigterm", trainer):
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._fire(trainer, "validation")


class Stopper(pl.Callback):
    """Stops the loop (``trainer.should_stop``) after the batch ``at`` (epoch, index)."""

    def __init__(self, at: tuple[int, int]) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == self.at:
            trainer.should_stop = True


class StepSaver(Checkpoint):
    """A checkpoint at every optimizer step (as ``ModelCheckpoint(every_n_train_steps=1)``), noting which
    were written at an epoch's last batch: Lightning resumes from those without running that epoch's
    end (``on_train_epoch_end``, so ``EarlyStopping`` and ``ReduceLROnPlateau`` miss it), with or without
    this package, so a configuration with such monitors resumes from an earlier one."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.saved, self._last = folder, [], 0  # saved: (path, at an epoch's last batch)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._last = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            path = self.folder / f"step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            last = trainer.fit_loop.epoch_loop.batch_idx + 1 >= trainer.num_training_batches
            self.saved.append((path, last))

    def latest(self, avoid_epoch_end: bool) -> Path | None:
        found = [path for path, last in self.saved if not (avoid_epoch_end and last)]
        return found[-1] if found else None


def _fit(
    c: Config,
    tmp: Path,
    recorder: Recorder,
    saver: StepSaver,
    fault: Interrupter | None,
    ckpt: Path | None,
    model: _Base | None = None,
) -> pl.LightningModule:
    first = model is None  # (else `trainer.fit` again on the model of an earlier fit)
    if model is None:
        model = Manual(c, recorder.data) if c.adapter == "mixin" else Automatic(c, recorder.data)
    callbacks: list[pl.Callback] = [recorder]
    if first and c.refit is not None:
        callbacks.append(Stopper((c.refit[0], c.refit[1])))
    ema = model.window_ema = WindowEMA()
    model.recorder = Shared(recorder)  # (the gradients before clipping: `_Base.clip_gradients`)
    if first:  # (a refit reuses the first fit's: their progress goes on, as the mixin's model's)
        model.package_callbacks = package_callbacks(c)
    callbacks += model.package_callbacks
    if "model_checkpoint" in c.callbacks:
        callbacks.append(ModelCheckpoint(tmp / "user", every_n_train_steps=2, save_top_k=-1))
    if "lr_monitor" in c.callbacks:
        callbacks.append(LearningRateMonitor("step"))
    if "early_stopping" in c.callbacks:
        strict = c.monitor == "probe"
        callbacks.append(
            EarlyStopping(monitored(c), patience=1, mode="min", check_on_train_epoch_end=True, strict=strict)
        )
    if "ema" in c.callbacks:
        callbacks.append(ema)
    if "progress_bar" in c.callbacks:
        callbacks.append(SilentBar())
    if c.swa is not None:
        callbacks.append(StochasticWeightAveraging(swa_lrs=c.swa[0], swa_epoch_start=int(c.swa[1])))
    callbacks += [saver, OnExceptionCheckpoint(tmp, "on_exception")]
    if fault is not None:
        callbacks.append(fault)
        model.fault = fault  # type: ignore[assignment]
    clip = {} if c.clip is None or c.adapter == "mixin" else {
        "gradient_clip_val": c.clip[0], "gradient_clip_algorithm": c.clip[1]}  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=c.precision,  # type: ignore[arg-type]
        max_epochs=c.epochs,
        max_steps=c.max_steps,
        limit_train_batches=c.limit_train_batches,
        val_check_interval=c.val_every,
        limit_val_batches=1 if c.val_every else 0,
        num_sanity_val_steps=0,
        logger=CSVLogger(tmp) if "lr_monitor" in c.callbacks else False,
        enable_progress_bar="progress_bar" in c.callbacks,
        enable_model_summary=False,
        callbacks=callbacks,
        **clip,
    )
    data = recorder.data
    trainer.fit(model, recorder.loader, ResumingLoader(data, c.batch_size), ckpt_path=ckpt)
    return model


def quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run(c: Config) -> Result:
    # (issue 52) the callback (and the mixin with `read_ahead`) read a `Budget`'s counts ahead from the loader on one
    # process too, as on ranks, so that the reading ahead (a stateful loader's state, resumes, a batch trained again)
    # meets the reference
    before, ahead.ON_ONE_PROCESS = ahead.ON_ONE_PROCESS, True
    try:
        return _run(c)
    finally:
        ahead.ON_ONE_PROCESS = before


def _run(c: Config) -> Result:
    quiet()
    with tempfile.TemporaryDirectory() as name, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = Path(name)
        data = Data(c)
        recorder = Recorder(data, ResumingLoader(data, c.batch_size), grads=c.bf16)
        saver = StepSaver(tmp / "steps")
        pending = [Interrupter(kind, epoch, batch, tmp / f"save{i}.ckpt") for i, (kind, epoch, batch) in
                   enumerate(c.interruptions)]  # fmt: skip
        ckpt: Path | None = None
        while True:
            fault = pending[0] if pending else None
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    model = _fit(c, tmp, recorder, saver, fault, ckpt)
                except (Injected, Interrupted, SystemExit):
                    assert fault is not None and fault.fired
                else:
                    if fault is None or not fault.fired:
                        break
            pending.pop(0)
            if fault.kind == "save":
                ckpt = fault.path
            elif any("does not continue exactly" in str(w.message) for w in seen):
                ckpt = saver.latest(c.monitors())  # the package left the window out: resume at a step, as it says
            else:
                ckpt = tmp / "on_exception.ckpt"
            if ckpt is None:  # failed before any step was saved: start again (Lightning would resume from
                recorder.lrs.clear()  # the on-exception checkpoint when given none)
                if recorder.grads is not None:
                    recorder.grads.clear()
                (tmp / "on_exception.ckpt").unlink()
        first_grads: list[list[Tensor | None]] = []  # (a refit's first fit's steps' gradients)
        if c.refit is not None:  # `trainer.fit` again, a new Trainer and callbacks, no checkpoint
            if recorder.grads is not None:
                first_grads = [recorder.grads[s] for s in sorted(recorder.grads)]
            recorder = Recorder(data, ResumingLoader(data, c.batch_size), grads=c.bf16)
            model = _fit(c, tmp, recorder, StepSaver(tmp / "refit"), None, None, model=model)  # type: ignore[arg-type]
        trainer = model.trainer
        params = [p.detach().clone() for p in model.net.parameters()]
        lrs = [recorder.lrs[s] for s in sorted(recorder.lrs)]
        ema = model.window_ema.average if "ema" in c.callbacks else None
        buffers = [b.detach().clone() for b in model.net.buffers()] if c.batchnorm else None
        # (each step's gradient over both fits of a refit, as the reference's)
        grads = None if recorder.grads is None else first_grads + [recorder.grads[s] for s in sorted(recorder.grads)]
        return Result(params, trainer.global_step, lrs, optimizer_state(c, trainer.optimizers), ema, buffers, grads)
