"""The mixin's driver: all it keeps on the module, and its part in Lightning's loop.

``MixinDriver`` is the one private object ``AccumulationMixin`` puts on the user's
module. It holds the configuration and one ``WindowEngine`` per
window group, runs the backward passes under the sync plan, and at a window's end makes the
gradient global, steps the optimizers and their step-interval LR schedulers and resets the
gradients. As a callback (attached through ``configure_callbacks``) it rescales, decays and
clips inside Lightning's optimizer step, after AMP unscaling, and carries the state in
checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _seam, gradients, groups, multitask, recovery, schedulers, sync
from lightning_accum._lightning import Callback, loss_scale, pl
from lightning_accum.checkpoint import load_partial, save_partial
from lightning_accum.engine import WindowEngine
from lightning_accum.groups import GroupKey
from lightning_accum.guards import MixinGuards
from lightning_accum.microbatch import AutoSize
from lightning_accum.options import AccumulationConfig
from lightning_accum.probe import check_noise_under
from lightning_accum.schedules import as_schedule
from lightning_accum.window import Window, sample_count
from lightning_accum.window_step import WindowStep


class MixinDriver(Callback):
    """State and window-end work of ``AccumulationMixin`` (internal)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.config = AccumulationConfig(schedule=as_schedule(1))
        self.engines: dict[GroupKey, WindowEngine] = {}
        self.auto = AutoSize()  # `backward_microbatches(size="auto")`: the size found, each window's passes
        self.plan = sync.SyncPlan()
        self._log_every = 0  # the loggers' cadence in optimizer steps, while logging
        self.step = WindowStep()  # the window-end step
        self._saved_grads: list[Tensor | None] | None = None
        self._partial: dict[str, Any] | None = None  # a resumed window's checkpoint state, until train start
        self.configured = False  # whether `configure_accumulation` was called
        self._batch_counts: tuple[Any, int, int | Tensor | None] | None = None  # the training batch, counted early
        self._block_counts: tuple[int, int | Tensor | None] = (0, None)  # the open block's (samples, items)
        self.guards = MixinGuards()
        self._open_block: GroupKey | None = None  # the group of the `accumulate` block under way
        self._block_passes = 0
        self._redoing = False  # the block's micro-batch is one a checkpoint already holds
        self.monitors: schedulers.Monitors = {}  # the LR schedulers' monitors, which Lightning drops here
        self._trained = False

    @property
    @override
    def state_key(self) -> str:
        return "AccumulationMixin"

    def configure(self, config: AccumulationConfig) -> None:
        self.config, self.configured = config, True
        for engine in self.engines.values():
            engine.configure(config.schedule, config.normalize, config.lr_scaling, config.lr_schedule)

    def engine(self, key: GroupKey) -> WindowEngine:
        engine = self.engines.get(key)
        if engine is None:
            c = self.config
            engine = self.engines[key] = WindowEngine(c.schedule, c.normalize, c.lr_scaling, c.lr_schedule)
            engine.start_fit(self.plan, self._log_every)
        return engine

    # ------------------------------------------------------------------ the module's optimizers
    def optimizers(self) -> list[Any]:
        return groups.optimizers(self.module)

    def key(self, optimizer: Any) -> GroupKey:
        return groups.key(self.module, optimizer)

    def params(self, key: GroupKey | None = None) -> list[Tensor]:
        return groups.params(self.module, key)

    def window_open(self) -> bool:
        """Whether some window holds gradient that is not stepped yet."""
        return any(e.window is not None and e.window.microbatches for e in self.engines.values())

    # ------------------------------------------------------------------ checks and fit lifetime
    def check(self, trainer: Any) -> None:
        self.guards.check_fit(self.module, trainer, self, configured=True)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.monitors = {}
            _seam.keep_scheduler_monitors(self.module, self.monitors)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guards.check_fit(self.module, trainer, self, self.configured)
        sync.refuse_deepspeed(trainer.strategy, "AccumulationMixin")
        self.plan = sync.plan(trainer.strategy, self.config.sync)
        self._log_every = getattr(trainer, "log_every_n_steps", 0) if self.config.log else 0
        for engine in self.engines.values():
            engine.start_fit(self.plan, self._log_every)
        check_noise_under(self.plan, self.config.schedule, self.config.lr_scaling)
        sync.refuse_fsdp_root_skip(self.plan, trainer.strategy.model)

    def _open_engines(self) -> list[WindowEngine]:
        return [self.engines[key] for key in sorted(self.engines) if self.engines[key].window is not None]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _seam.resume_after_finished_epoch(trainer)
        self._trained = False  # whether a batch of this fit ended yet
        if self._partial is not None:  # resumed inside a window: this rank's own part of it
            numbers, self._saved_grads = load_partial(self._partial, trainer.strategy, trainer.global_rank)
            for i, engine in enumerate(self._open_engines() if numbers is not None else []):
                engine.load_local_numbers(numbers[engine.NUMBERS * i : engine.NUMBERS * (i + 1)])  # type: ignore[index]
            self._partial = None
        if self._saved_grads is not None:
            gradients.restore(self.params(), self._saved_grads)
            self._saved_grads = None
        if self.config.decay is not None:
            self.config.decay.attach(trainer.optimizers)
        self.guards.attach(trainer.optimizers)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.decay is not None:
            self.config.decay.detach()
        self.guards.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # before the checkpoint callbacks' `on_exception`: the state a checkpoint written now must hold
        processed, in_backward = recovery.where(trainer, exception)
        batch, rescaled = (trainer.current_epoch, _seam.batch_index(trainer)), self.step.rescaled
        for key, engine in self.engines.items():
            open_pass = key == self._open_block and self._block_passes > 0
            recovery.settle(
                engine, batch, processed=processed, in_backward=in_backward, open_pass=open_pass, rescaled=rescaled
            )
        self._open_block = None
        if self.config.decay is not None:
            self.config.decay.settle(processed)
            self.config.decay.detach(restore_residual=False)
        self.guards.detach()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for engine in self.engines.values():
            engine.batch_done()
        self.guards.batch_end(self.module, outputs, first=not self._trained)
        self._trained = True
        if _seam.epoch_ends_after_this_batch(trainer):  # as Lightning: before the batch's checkpoints; plateau later
            epochs = trainer.current_epoch + 1
            schedulers.step_schedulers(self.module, trainer, self.monitors, "epoch", epochs, plateau=False)

    # ------------------------------------------------------------------ backward passes
    def no_sync(self, final: bool) -> contextlib.AbstractContextManager[None]:
        """Context of one backward pass. DDP: always no-sync, the window is all-reduced explicitly
        at its end. FSDP, FSDP2: sync skipped before the window's last micro-batch if planned."""
        strategy = self.module.trainer.strategy
        if self.plan.family == "ddp":
            return sync.ddp_no_sync(strategy)
        return sync.skip_sync(self.plan, strategy, final)

    def backward(self, loss: Tensor, final: bool) -> None:
        self._block_passes += 1
        # a checkpoint holds this batch's gradient already: it adds nothing
        handles = gradients.add_nothing(self.params()) if self._redoing else []
        try:
            with self.guards.own_pass(), self.no_sync(final):
                self.module.manual_backward(loss)
        finally:
            for handle in handles:
                handle.remove()

    def record_loss(self, key: GroupKey, loss: Tensor, name: str = "loss") -> None:
        """A pass's loss (before the window's division), or a task's, for the logged window loss."""
        if not self._redoing:
            self.engines[key].metrics.add_loss(loss, name)

    def trunk_backward(self, features: Tensor | Sequence[Tensor], grad: Tensor | Sequence[Tensor], final: bool) -> None:
        self._block_passes += 1
        with self.no_sync(final):
            multitask._autograd_backward(features, grad)

    # ------------------------------------------------------------------ one window
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count the training batch before ``training_step`` can change it (``batch.pop("labels")``)."""
        if not self._trained:  # (the first batch after a resume: where Lightning's counters go off)
            _seam.keep_progress_consistent(trainer)
        self._batch_counts = None
        if self.config.count is not None:
            needed_by = self._samples_needed_by()
            self._batch_counts = (batch, sample_count(batch, needed_by), self.config.count(batch))

    def _samples_needed_by(self) -> str | None:
        """What needs each micro-batch's sample count (the same for every group)."""
        engine = next(iter(self.engines.values()), None)
        if engine is None:
            c = self.config
            engine = WindowEngine(c.schedule, c.normalize, c.lr_scaling, c.lr_schedule)
        return engine.samples_needed_by

    def begin(self, trainer: Any, key: GroupKey, batch: Any) -> tuple[Window, bool]:
        """The group's open window (opened now if none is), and whether this micro-batch is its last;
        the micro-batch is counted now, before the block's code runs."""
        if key not in self.engines:
            groups.check_disjoint(self.module, key, self.engines)
        engine = self.engine(key)
        epoch, batch_idx = trainer.current_epoch, _seam.batch_index(trainer)
        window = engine.window or engine.open(epoch, batch_idx, trainer.strategy)
        # a batch whose gradient a checkpoint holds already (saved on an exception after its block) adds nothing
        self._redoing = engine.redo == (epoch, batch_idx)
        filled = window.microbatches - self._redoing
        last = filled + 1 >= window.k or _seam.epoch_ends_after_this_batch(trainer)
        early = self._batch_counts
        if early is not None and early[0] is batch:
            self._block_counts = early[1], early[2]
        else:
            count = self.config.count
            self._block_counts = sample_count(batch, engine.samples_needed_by), None if count is None else count(batch)
        self.guards.blocks += 1
        self._open_block, self._block_passes = key, 0
        return window, last

    def finish(self, trainer: Any, key: GroupKey, passes: int, items: int | Tensor | None, last: bool) -> None:
        """Count a micro-batch that back-propagated (``passes`` > 0) and close the window at its last."""
        self._open_block = None
        engine = self.engines[key]
        window = engine.window
        assert window is not None
        if self._redoing:
            self._redoing = False
        elif passes:  # a micro-batch that back-propagated nothing does not count
            self.guards.passes += passes
            samples, counted = self._block_counts
            engine.count(samples, self._items(items, counted, samples))
            engine.backward_done()
            window.mark_synced(last)
            if not last and engine.wants_prefix():
                engine.measure_prefix(gradients.grads_of(self.params(key)), loss_scale(trainer))
        if last:
            self.step.close(
                trainer,
                self.module,
                key,
                engine,
                [self.optimizers()[i] for i in key],
                self.params(key),
                config=self.config,
                plan=self.plan,
                guards=self.guards,
                auto=self.auto,
                monitors=self.monitors,
                log_prefix="accum/" if len(self.engines) == 1 else f"accum/opt{'_'.join(map(str, key))}/",
            )

    def _items(self, items: int | Tensor | None, counted: int | Tensor | None, samples: int) -> int | Tensor:
        if items is not None:
            return items
        if counted is not None:
            return counted
        if self.config.normalize == "items":
            raise ValueError(
                "`normalize='items'` needs the micro-batch's item count: give `count=` to "
                "`configure_accumulation`, or call `acc.backward(loss, items=n)`."
            )
        return samples

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guards.epoch_end()
        if _seam.batches_ran_out(trainer):  # (as Lightning: not after `max_steps` cut the epoch short)
            schedulers.step_schedulers(
                self.module, trainer, self.monitors, "epoch", trainer.current_epoch + 1, plateau=True
            )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        config = self.config

        def clip(optimizer: Optimizer) -> None:
            pl_module.clip_gradients(
                optimizer,
                gradient_clip_val=config.gradient_clip_val,
                gradient_clip_algorithm=config.gradient_clip_algorithm,
            )

        self.step.before_optimizer_step(optimizer, config, self.plan.sharded, clip)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        groups = {",".join(map(str, key)): engine.state_dict() for key, engine in self.engines.items()}
        state: dict[str, Any] = {"groups": groups}
        if any(g["window"] is not None and g["window"]["microbatches"] for g in groups.values()):
            numbers = [v for e in self._open_engines() for v in e.local_numbers()]
            state.update(save_partial(self.module.trainer.strategy, numbers, self.params(), self._saved_grads))
        if self.config.decay is not None:
            state["decay"] = self.config.decay.state_dict()
        state["schedule"] = self.config.schedule.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engines = {}
        for name, group in state_dict["groups"].items():
            self.engine(tuple(int(i) for i in name.split(",") if i)).load_state_dict(group)
        self._partial = state_dict if "grads" in state_dict else None
        self.config.schedule.load_state_dict(state_dict.get("schedule", {}))
        if self.config.decay is not None and "decay" in state_dict:
            self.config.decay.load_state_dict(state_dict["decay"])
