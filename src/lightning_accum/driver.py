"""The mixin's driver: its part in Lightning's loop, and all it keeps on the module.

``MixinDriver`` is the one private object ``AccumulationMixin`` puts on the user's module, a
callback attached through ``configure_callbacks``. It holds the mixin's parts, each with its own
state: the window groups and their engines (``MixinWindows``), the window-end step
(``WindowStep``), the out-of-memory auto-sizing (``AutoSize``), a checkpoint's partial window
(``PartialWindow``) and the misuse guards; it opens and ends each ``accumulate`` block
(``Block``), runs their Lightning hooks, and builds its ``state_dict`` from theirs.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _seam, recovery, schedulers, steps, sync
from lightning_accum._lightning import Callback, loss_scale, pl
from lightning_accum.block import Block
from lightning_accum.checkpoint import PartialWindow
from lightning_accum.guards import MixinGuards
from lightning_accum.microbatch import AutoSize
from lightning_accum.options import AccumulationConfig
from lightning_accum.probe import check_noise_under
from lightning_accum.samples import sample_count
from lightning_accum.window_step import WindowStep
from lightning_accum.windows import MixinWindows


class MixinDriver(Callback):
    """Lightning's hooks for ``AccumulationMixin``, over its parts (internal)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.windows = MixinWindows(module)  # the window groups, one engine each
        self.step = WindowStep()  # the window-end step
        self.auto = AutoSize()  # `backward_microbatches(size="auto")`: the size found, each window's passes
        self.partial = PartialWindow()  # a resumed window's part a checkpoint held
        self.guards = MixinGuards()
        self.configured = False  # whether `configure_accumulation` was called
        self.plan = sync.SyncPlan()
        self.monitors: schedulers.Monitors = {}  # the LR schedulers' monitors, which Lightning drops here
        self._early: tuple[Any, int, int | Tensor | None] | None = None  # the training batch, counted early
        self._block: Block | None = None  # the `accumulate` block under way
        self._trained = False  # whether a batch of this fit ended yet

    @property
    def config(self) -> AccumulationConfig:
        return self.windows.config

    @property
    @override
    def state_key(self) -> str:
        return "AccumulationMixin"

    def configure(self, config: AccumulationConfig) -> None:
        self.windows.configure(config)
        self.configured = True

    # ------------------------------------------------------------------ fit lifetime
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
        self.windows.start_fit(self.plan, self.config.log)
        check_noise_under(self.plan, self.config.schedule, self.config.lr_scaling)
        sync.refuse_fsdp_root_skip(self.plan, trainer.strategy.model)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _seam.resume_after_finished_epoch(trainer)
        self._trained = False
        numbers = self.partial.numbers(trainer.strategy, trainer.global_rank, trainer.ckpt_path)  # resumed in a window
        if numbers is not None:
            self.windows.load_local_numbers(numbers)
        self.partial.put_back(self.windows.params())
        if self.config.decay is not None:
            self.config.decay.attach(trainer.optimizers)
        self.guards.attach(trainer.optimizers)
        steps.warn_scheduler_horizons(trainer)
        self.step.start_training(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.decay is not None:
            self.config.decay.detach()
        self.guards.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # before the checkpoint callbacks' `on_exception`: the state a checkpoint written now must hold
        processed, in_backward = recovery.where(trainer, exception)
        block, self._block = self._block, None
        open_key = block.key if block is not None and block.passes else None
        batch, rescaled = (trainer.current_epoch, _seam.batch_index(trainer)), self.step.rescaled
        for key, engine in self.windows.engines.items():
            open_pass = key == open_key
            recovery.settle(
                engine, batch, processed=processed, in_backward=in_backward, open_pass=open_pass, rescaled=rescaled
            )
        if self.config.decay is not None:
            self.config.decay.settle(processed)
            self.config.decay.detach(restore_residual=False)
        self.guards.detach()

    # ------------------------------------------------------------------ one batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count the training batch before ``training_step`` can change it (``batch.pop("labels")``)."""
        if not self._trained:  # (the first batch after a resume: where Lightning's counters go off)
            _seam.keep_progress_consistent(trainer)
        self._early = None
        if self.config.count is not None:
            self._early = (batch, sample_count(batch, self.windows.samples_needed_by()), self.config.count(batch))

    def begin(self, trainer: Any, optimizer: Any, batch: Any) -> Block:
        """Open an ``accumulate`` block: the group's window (opened now if none is), whether this
        micro-batch is its last, and its counts, taken before the block's code runs."""
        windows = self.windows
        key = windows.key(optimizer)
        windows.check_disjoint(key)
        engine = windows.engine(key)
        epoch, batch_idx = trainer.current_epoch, _seam.batch_index(trainer)
        window = engine.window or engine.open(epoch, batch_idx, trainer.strategy)
        # a batch whose gradient a checkpoint holds already (saved on an exception after its block) adds nothing
        redoing = engine.redo == (epoch, batch_idx)
        last = window.microbatches - redoing + 1 >= window.k or _seam.epoch_ends_after_this_batch(trainer)
        early = self._early
        if early is not None and early[0] is batch:
            counts: tuple[int, int | Tensor | None] = early[1], early[2]
        else:
            count = self.config.count
            counts = sample_count(batch, engine.samples_needed_by), None if count is None else count(batch)
        self.guards.block_opened()
        self._block = Block(
            windows, key, window, last=last, redoing=redoing, counts=counts, plan=self.plan, guards=self.guards
        )
        return self._block

    def finish(self, trainer: Any, block: Block) -> None:
        """The block exited: count its micro-batch, and step the window at its last."""
        self._block = None
        block.finish(lambda: loss_scale(trainer))
        if block.last:
            key = block.key
            self.step.close(
                trainer,
                self.module,
                key,
                block.engine,
                [self.windows.optimizers()[i] for i in key],
                block.params(),
                config=self.config,
                plan=self.plan,
                guards=self.guards,
                auto=self.auto,
                monitors=self.monitors,
                log_prefix="accum/" if len(self.windows.engines) == 1 else f"accum/opt{'_'.join(map(str, key))}/",
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

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.windows.batch_done()
        self.guards.batch_end(self.module, outputs, first=not self._trained)
        self._trained = True
        if _seam.epoch_ends_after_this_batch(trainer):  # as Lightning: before the batch's checkpoints; plateau later
            epochs = trainer.current_epoch + 1
            schedulers.step_schedulers(self.module, trainer, self.monitors, "epoch", epochs, plateau=False)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guards.epoch_end()
        if _seam.batches_ran_out(trainer):  # (as Lightning: not after `max_steps` cut the epoch short)
            epochs = trainer.current_epoch + 1
            schedulers.step_schedulers(self.module, trainer, self.monitors, "epoch", epochs, plateau=True)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        groups = self.windows.state_dict()
        state: dict[str, Any] = {"groups": groups}
        if any(g["window"] is not None and g["window"]["microbatches"] for g in groups.values()):
            strategy, params = self.module.trainer.strategy, self.windows.params()
            state.update(self.partial.save(strategy, self.windows.local_numbers(), params))
        if self.config.decay is not None:
            state["decay"] = self.config.decay.state_dict()
        state["reported"] = self.step.reported.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.windows.load_state_dict(state_dict["groups"])
        self.partial.load(state_dict)
        if self.config.decay is not None and "decay" in state_dict:
            self.config.decay.load_state_dict(state_dict["decay"])
        self.step.reported.load_state_dict(state_dict.get("reported", {}))
