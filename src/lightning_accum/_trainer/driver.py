"""The mixin's driver: its part in Lightning's loop, and all it keeps on the module.

``MixinDriver`` is the one private object ``AccumulationMixin`` puts on the user's module, a
callback attached through ``configure_callbacks``. It holds the mixin's parts, each with its own
state: the window groups and their engines (``MixinWindows``), the window-end step
(``WindowStep``), the out-of-memory auto-sizing (``AutoSize``), a checkpoint's partial window
(``PartialWindow``) and the misuse guards; it opens and ends each ``accumulate`` block
(``Block``), runs their Lightning hooks, and builds its ``state_dict`` from theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _seam
from lightning_accum._core import sync
from lightning_accum._core.checkpoint import PartialWindow
from lightning_accum._core.microbatch import AutoSize
from lightning_accum._core.options import AccumulationConfig
from lightning_accum._core.probe import check_noise_under
from lightning_accum._core.samples import sample_count
from lightning_accum._core.wide import inert_note, refuse_under
from lightning_accum._core.window import batch_counts, check_count
from lightning_accum._lightning import Callback, loss_scale, pl, rank_zero_warn
from lightning_accum._trainer import fit_checks, recovery, schedulers, steps, window_step
from lightning_accum._trainer.ahead import BudgetAhead
from lightning_accum._trainer.block import Block
from lightning_accum._trainer.guards import MixinGuards, refuse_callbacks
from lightning_accum._trainer.windows import GroupKey, MixinWindows
from lightning_accum.schedules import Budget


class MixinDriver(Callback):
    """Lightning's hooks for ``AccumulationMixin``, over its parts (internal)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.windows = MixinWindows(module)  # the window groups, one engine each
        self.step = window_step.WindowStep()  # the window-end step
        self.auto = AutoSize()  # `backward_microbatches(size="auto")`: the size found, each window's passes
        self.partial = PartialWindow()  # a resumed window's part a checkpoint held
        self.guards = MixinGuards()
        self.configured = False  # whether `configure_accumulation` was called
        self.plan = sync.SyncPlan()
        self.schedulers = schedulers.MixinSchedulers()  # the fit's LR schedulers, under `step_schedulers`
        self._undo_plateau: Callable[[], None] = _nothing  # takes back a plateau step due after the epoch end
        self._plateau_point: Callable[[], None] = _nothing  # takes back the step-interval plateau steps' seam
        self._early: tuple[Any, int, int | Tensor | None] | None = None  # the training batch, counted early
        self._block: Block | None = None  # the `accumulate` block under way
        self._closing_left_open: GroupKey | None = None  # the group stepped at an epoch's end outside a block
        self._trained = False  # whether a batch of this fit ended yet
        self._restored = False  # whether this fit's checkpoint restored the windows
        self._fitting: pl.Trainer | None = None  # the fit being set up, till train start (its checkpoint checked)
        # `read_ahead=True`: a budget's counts read ahead from the loader, and the blocks of this `training_step`
        self.ahead = BudgetAhead(
            "`configure_accumulation(read_ahead=True)`",
            "Give `self.accumulate` the batch `training_step` got (count what the loader yields, e.g. in the collate "
            "function; change a batch there, not in `training_step` or the batch transfer hooks), or leave "
            "`read_ahead` out.",
        )
        self._blocks_in_step = 0

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
        self._fitting = trainer if stage == "fit" else None  # (a checkpoint validated elsewhere is not refused)
        if stage == "fit":
            refuse_callbacks(self.module, trainer.callbacks)  # type: ignore[attr-defined]
            # (the keys Lightning drops in manual optimization, for `step_schedulers=True`)
            _seam.keep_scheduler_keys(self.module, self.schedulers.fresh(), lambda: bool(self.config.step_schedulers))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guards.check_fit(self.module, trainer, self, self.configured)
        sync.refuse_deepspeed(trainer.strategy, "AccumulationMixin")
        self.plan = sync.plan(trainer.strategy, self.config.sync)
        self.windows.start_fit(self.plan, self.config.log)
        if not self._restored:  # a fit not resumed from a checkpoint continues no window an earlier fit left open
            self._forget_open_windows()  # (stopped or failed inside it; Lightning zeroes the gradients next)
        self._restored = False
        check_noise_under(self.plan, self.config.schedule, self.config.lr_scaling)
        if self.windows.batchnorm is not None:
            self.windows.batchnorm.attach(self.module)
        sync.refuse_fsdp_root(self.plan, trainer.strategy.model)
        dtype = self.config.grad_accum_dtype
        refuse_under(self.plan.family, dtype, "AccumulationMixin")
        if not self.windows.widen() and dtype is not None:
            rank_zero_warn(inert_note(dtype))
        custom_step = type(self.module).lr_scheduler_step is not pl.LightningModule.lr_scheduler_step
        self.schedulers.check_fit(trainer.lr_scheduler_configs, self.module, self.config.step_schedulers, custom_step)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_checks.refuse_uneven_budget_data(trainer, self.config.schedule, "configure_accumulation")
        _seam.resume_after_finished_epoch(trainer)
        self.ahead.stop()
        if self.config.read_ahead and isinstance(self.config.schedule, Budget):
            self.ahead.start(trainer)
        self._trained, self._fitting = False, None
        numbers = self.partial.numbers(trainer.strategy, trainer.global_rank, trainer.ckpt_path)  # resumed in a window
        if numbers is not None:
            self.windows.load_local_numbers(numbers)
        self.partial.put_back(self.windows.params(), self.windows.wide_sums())
        if self.config.decay is not None:
            self.config.decay.keep_wide(self.windows.wide_sums())
            self.config.decay.attach(trainer.optimizers)
        self.guards.attach(trainer.optimizers, self.windows.optimizers(), self.windows.window_open)
        if self.config.step_schedulers:
            steps.warn_scheduler_horizons(trainer, optimizers=len(trainer.optimizers))
            self.schedulers.watch(trainer.lr_scheduler_configs)
            self._release_plateau_point()

            def step_due() -> None:  # (where Lightning's loop steps its step-interval plateau schedulers)
                self.schedulers.step_due(self.module, trainer)

            self._plateau_point = _seam.at_plateau_point(trainer, step_due)
        self.step.start_training(trainer)

    def _forget_open_windows(self) -> None:
        for key, engine in self.windows.engines.items():
            if engine.window is not None:
                engine.discard()
                self.auto.forget(key)

    def _check_schedulers(self, trainer: Any) -> None:
        """Under ``step_schedulers=True``: refuse a scheduler the model stepped itself."""
        if self.config.step_schedulers:
            self.schedulers.check_untouched(trainer.lr_scheduler_configs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ahead.stop()
        self._undo_plateau()
        self._release_plateau_point()
        self._check_schedulers(trainer)

    def _release_plateau_point(self) -> None:
        self._plateau_point()
        self._plateau_point = _nothing
        self.schedulers.drop_due()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.decay is not None:
            self.config.decay.detach()
        self.guards.detach()
        self.windows.unwiden()
        if self.windows.batchnorm is not None:
            self.windows.batchnorm.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # before the checkpoint callbacks' `on_exception`: the state a checkpoint written now must hold
        self.ahead.forget()  # (the loader's state as without the reading ahead stays for them; the counts go)
        self._undo_plateau()
        self._release_plateau_point()  # (a plateau step due at this batch's end is not taken, as in Lightning)
        processed, in_backward = recovery.where(trainer, exception)
        block, self._block = self._block, None
        open_key = block.key if block is not None and block.passes else None
        batch, rescaled = (trainer.current_epoch, _seam.batch_index(trainer)), self.step.rescaled
        closing, self._closing_left_open = self._closing_left_open, None
        for key, engine in self.windows.engines.items():
            if key == closing:  # (its batch is processed: Lightning will not train it again, nor end its window)
                recovery.abandon(engine, "the accumulation window was being stepped at the epoch's end")
                continue
            open_pass = key == open_key
            recovery.settle(
                engine, batch, processed=processed, in_backward=in_backward, open_pass=open_pass, rescaled=rescaled
            )
        if self.config.decay is not None:
            self.config.decay.settle(processed)
            self.config.decay.detach(restore_residual=False)
        self.guards.detach()
        self.windows.unwiden()
        if self.windows.batchnorm is not None:
            self.windows.batchnorm.detach()

    # ------------------------------------------------------------------ one batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count the training batch before ``training_step`` can change it (``batch.pop("labels")``)."""
        if not self._trained:  # (the first batch after a resume: where Lightning's counters go off)
            _seam.keep_progress_consistent(trainer)
        self.guards.batch_start()
        self._early, self._blocks_in_step = None, 0
        if self.config.count is not None and batch is not None:  # (`None`: a `training_step` of the `dataloader_iter`)
            self._early = (batch, sample_count(batch, self.windows.samples_needed_by()), self.config.count(batch))

    def begin(self, trainer: Any, optimizer: Any, batch: Any) -> Block:
        """Open an ``accumulate`` block: the group's window (opened now if none is), whether this
        micro-batch is its last, and its counts, taken before the block's code runs."""
        self._check_schedulers(trainer)
        self._one_block_per_step()
        windows = self.windows
        key = windows.key(optimizer)
        windows.check_disjoint(key)
        windows.refuse_window_of_some(key)  # (`batchnorm="window"`: one window of every optimizer)
        if self.config.grad_accum_dtype is not None:
            windows.widen_joined()
        engine = windows.engine(key)
        epoch, batch_idx = trainer.current_epoch, _seam.batch_index(trainer)
        if engine.window is None and self.config.grad_accum_dtype is not None:
            windows.rewiden()  # (a param group added, a layer unfrozen)
        window = engine.window or engine.open(epoch, batch_idx, trainer.strategy)
        # a batch whose gradient a checkpoint holds already (saved on an exception after its block) adds nothing
        redoing = engine.redo == (epoch, batch_idx)
        early = self._early
        if early is not None and early[0] is batch:
            counts: tuple[int, int | Tensor | None] = early[1], early[2]
        else:
            count = self.config.count
            counts = sample_count(batch, engine.samples_needed_by), None if count is None else count(batch)
        # (under a `Budget`, the block's count over ranks against the window's budget: `count(batch)`, or its samples;
        # its all-reduce goes out now, and is read where the block first needs the window's end: `Block.last`)
        # (`read_ahead=True`: read ahead from the loader, its all-reduce out a chunk before, `BudgetAhead`)
        items = counts[0] if counts[1] is None else counts[1]
        total = None
        if not redoing and self.ahead.reading:
            items = check_count(items)  # (a count of more than one number refused here, as `ask` refuses it)
            total = self.ahead.total(
                trainer,
                batch_idx,
                lambda: engine.budget_count(counts[0], items, warn=False),
                lambda batch: engine.budget_count(*batch_counts(batch, engine.samples_needed_by, self.config.count)),
            )
            self.ahead.check(batch_idx, counts[0], items, getattr(engine.schedule, "unit", None) == "samples")
        elif not redoing:
            engine.ask(counts[0], items, trainer.strategy)
        strategy, epoch_ends = trainer.strategy, _seam.epoch_ends_after_this_batch(trainer)

        def last() -> bool:
            return engine.closes_after(counts[0], items, strategy, again=redoing, total=total) or epoch_ends

        watched = [] if len(key) == len(windows.optimizers()) or self.plan.sharded else windows.params()
        self.guards.block_opened(key, lambda: windows.params(key), watched, self._parameter_names)
        self._block = Block(
            windows, key, window, last=last, redoing=redoing, counts=counts, plan=self.plan, guards=self.guards
        )
        engine.batch_start()  # (`batchnorm="window"`: the block's forwards pooled, till it exits)
        return self._block

    def _one_block_per_step(self) -> None:
        """``read_ahead=True``: a ``training_step`` runs at most one ``accumulate`` block (the batch's count read
        ahead stands for one micro-batch, at the step's batch index)."""
        if not self.config.read_ahead:
            return
        if self._blocks_in_step:
            raise RuntimeError(
                "A second `self.accumulate(...)` block in one `training_step` under `configure_accumulation("
                "read_ahead=True)`: reading ahead takes each loader batch as one micro-batch, at the step's batch "
                "index, so a `training_step` runs at most one block, on its batch. Run one block per step (split a "
                "batch with `acc.backward_microbatches` inside it), or leave `read_ahead` out."
            )
        self._blocks_in_step += 1

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.module.named_parameters()}

    def block_exited(self, block: Block, finished: bool) -> None:
        """The ``accumulate`` block's code ended (or raised: ``finished`` False, its micro-batch adds nothing to
        the window's BatchNorm statistics, and a layer whose forward raised gets its own buffers back)."""
        self.guards.block_exited()
        if not finished:
            block.engine.microbatch_over()
            self._blocks_in_step = 0  # (`read_ahead=True`: its micro-batch went in nowhere: it may run again)

    def finish(self, trainer: Any, block: Block) -> None:
        """The block exited: count its micro-batch, and step the window at its last."""
        self._block = None
        block.finish(lambda: loss_scale(trainer))
        block.engine.microbatch_over()  # (what it did not count adds nothing; the hooks rest)
        if block.last:
            self._close(trainer, block.key)

    def _close(self, trainer: Any, key: GroupKey) -> None:
        """Step the group's window (``WindowStep.close``)."""
        self._check_schedulers(trainer)  # (before the step that would use a scheduler the model stepped)
        self.step.close(
            trainer,
            self.module,
            key,
            self.windows.engines[key],
            [self.windows.optimizers()[i] for i in key],
            self.windows.params(key),
            config=self.config,
            plan=self.plan,
            guards=self.guards,
            auto=self.auto,
            schedulers=self.schedulers if self.config.step_schedulers else None,
            log_prefix=self.windows.log_prefix(key),
        )

    def _close_left_open(self, trainer: Any) -> None:
        """At an epoch's last batch: step the windows it ran no block of (a skipped batch, a window of another
        optimizer), cut short at the epoch's end as every window is."""
        for key in sorted(self.windows.engines):  # (the same order on every rank)
            if self.windows.engines[key].window is not None:
                self._closing_left_open = key
                self._close(trainer, key)
        self._closing_left_open = None

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
        self.guards.batch_end(self.module, outputs, blocks_ran=bool(self.windows.engines))
        self._trained = True
        if _seam.epoch_ends_after_this_batch(trainer):
            with _seam.steps_counted(trainer):
                self._close_left_open(trainer)
        if not self.config.step_schedulers:
            return
        self.schedulers.check_untouched(trainer.lr_scheduler_configs)
        if _seam.epoch_ends_after_this_batch(trainer):  # as Lightning: before the batch's checkpoints; plateau later
            epochs = trainer.current_epoch + 1
            self.schedulers.step(self.module, trainer, "epoch", epochs, plateau=False)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._undo_plateau()
        self._check_schedulers(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for key in sorted(self.windows.engines):  # windows the epoch's last batch did not reach: the loop stopped
            engine = self.windows.engines[key]  # inside them (`should_stop`, `max_steps`, a batch start returning -1)
            if engine.window is not None:  # and, as Lightning's automatic loop, steps none of them
                window_step.drop(engine, self.windows.params(key), self.config)
                self.auto.forget(key)
        self.guards.epoch_end()
        if self.config.step_schedulers and _seam.batches_ran_out(trainer):  # (as Lightning: not after `max_steps`
            epochs = trainer.current_epoch + 1  # cut the epoch short) and after the module's `on_train_epoch_end`

            def plateau() -> None:
                self._undo_plateau = _nothing
                self.schedulers.step(self.module, trainer, "epoch", epochs, plateau=True)

            self._undo_plateau = _seam.after_module_hook(self.module, "on_train_epoch_end", plateau)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        groups = self.windows.state_dict()
        state: dict[str, Any] = {"groups": groups}
        if any(g["window"] is not None and g["window"]["microbatches"] for g in groups.values()):
            strategy, params = self.module.trainer.strategy, self.windows.params()
            state.update(self.partial.save(strategy, self.windows.local_numbers(), params, self.windows.wide_sums()))
        if self.config.decay is not None:
            state["decay"] = self.config.decay.state_dict()
        state["reported"] = self.step.reported.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fitting is not None:  # (a partial window on another world size: refused before anything changes)
            self.partial.check(state_dict, self._fitting.strategy, self._fitting.ckpt_path)
        self.windows.load_state_dict(state_dict["groups"])
        self._restored = True  # (not before: a refused checkpoint restores nothing)
        self.partial.load(state_dict)
        if self.config.decay is not None and "decay" in state_dict:
            self.config.decay.load_state_dict(state_dict["decay"])
        self.step.reported.load_state_dict(state_dict.get("reported", {}))


def _nothing() -> None:
    return None
