"""``AccumulationScheduler``: exact, scheduled gradient accumulation in automatic optimization."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_accum import _seam
from lightning_accum._core import gradients, sync
from lightning_accum._core.batchnorm import BatchNormMode, WindowBatchNorm, check_batchnorm
from lightning_accum._core.checkpoint import PartialWindow
from lightning_accum._core.engine import WindowEngine
from lightning_accum._core.metrics import weigh
from lightning_accum._core.microbatch import Split, check_split
from lightning_accum._core.options import (
    Count,
    LRScaling,
    MicrobatchSize,
    Reduction,
    check_callback_items,
    check_common,
    check_flag,
    check_microbatch_size,
)
from lightning_accum._core.probe import check_noise_under
from lightning_accum._core.samples import sample_count
from lightning_accum._core.sync import SyncMode, SyncPlan
from lightning_accum._core.wide import check_grad_accum_dtype, inert_note, refuse_under
from lightning_accum._core.window import Normalize, batch_counts, lightning_divisor
from lightning_accum._lightning import Callback, grad_scaler, loss_scale, pl, rank_zero_warn
from lightning_accum._seam import set_divisor, zero_grad_like_lightning
from lightning_accum._trainer import fit_checks, recovery, reporting, steps
from lightning_accum._trainer.ahead import BudgetAhead
from lightning_accum._trainer.pieces import Fit, Pieces
from lightning_accum.callbacks.decay import GradientDecay
from lightning_accum.lr import LRMultiplier
from lightning_accum.schedules import Budget, Progress, Schedule


class AccumulationScheduler(Callback):
    r"""Accumulate gradients over windows whose size follows a schedule, exactly.

    Each window holds the ``k`` micro-batches the schedule gave when it opened (changes apply
    from the next window, mid-epoch included; an epoch's last window may be short) and the
    stepped gradient is normalised by what really went in:

    * ``normalize="mean"``: the mean of the window's micro-batch gradients over all ranks, a
      short window included (Lightning's built-in divides a short window by the full ``k``);
    * ``normalize="items"``: ``training_step`` returns a sum over items (tokens, ...) with
      ``reduction="sum"``, or a mean with ``reduction="mean"`` (a Hugging Face ``outputs.loss``), and
      ``count(batch)`` gives the micro-batch's item count (e.g. ``lightning_accum.count.causal_lm_tokens``); the stepped
      gradient is the window's summed gradient over all ranks divided by its global item count.

    On DDP the gradients are all-reduced once per optimizer step. The rescale happens in
    ``on_before_optimizer_step``: after AMP unscaling, before gradient clipping. LR schedulers
    with ``interval="step"`` step once per optimizer step, and their ``frequency`` counts
    optimizer steps. ``lr_scaling`` and ``lr_schedule`` multiply every group's learning rate,
    for the step only.

    Args:
        schedule: a ``Schedule``, an ``int`` or an epoch-keyed ``dict``
            (as for Lightning's ``GradientAccumulationScheduler``).
        normalize: ``"mean"`` or ``"items"``.
        count: ``count(batch) -> int | Tensor``: items in a micro-batch; required for
            ``"items"``, optional otherwise (it feeds ``Progress.items``).
        reduction: ``"sum"`` or ``"mean"``: what ``training_step`` returns over a micro-batch's
            items; required with ``normalize="items"`` (a mean is weighted by ``count(batch)``), not
            used otherwise.
        lr_scaling: ``None``, ``"linear"``, ``"sqrt"`` or ``"adascale"`` (AdaScale's gain from the
            gradient noise measured in each window of k >= 2; ``Progress.scaled_steps`` sums it).
        lr_schedule: ``lr_schedule(progress) -> float``: a learning-rate multiplier for each step, keyed
            on the ``Progress`` its window opened with (shapes in ``lightning_accum.lr``).
        log: log ``accum/k`` and ``accum/loss`` (the window's loss; both in the progress bar),
            ``accum/grad_norm``, ``accum/lr`` (the learning rate each step used, ``lr_scaling`` and ``lr_schedule``
            included; ``accum/lr-Adam``, ... as ``LearningRateMonitor`` names them for several optimizers or
            groups), ``accum/effective_batch``, ``accum/samples``, ``accum/items`` every
            ``Trainer(log_every_n_steps)`` optimizer steps (when the loggers write); each number is computed
            only where something reads it (the guide's "Window metrics" says what is read by whom).
        sync: gradient sync inside a window on sharded strategies: ``"auto"`` (FSDP2: once per
            window; FSDP: every micro-batch, as Lightning), ``"skip"`` (once per window; FSDP and
            FSDP2 then hold unsharded gradients until its end) or ``"every"``. DDP always syncs
            once per window.
        microbatch_size: ``None`` (each loader batch is one micro-batch), an int (each loader batch is cut
            along dim 0 into pieces of at most this many samples, and ``training_step`` runs once per
            piece, its loss weighted by the piece's share; one piece's graph alive at a time) or
            ``"auto"`` (the loader batch, halved on out-of-memory; the window is kept exact). ``k`` still
            counts loader batches and nothing but memory (and BatchNorm's statistics) changes: see the
            guide's "Micro-batches that fit". Not under DeepSpeed or Lightning's FSDP.
        split: with ``microbatch_size``, ``split(path, leaf) -> bool`` says which leaves of a loader batch are cut
            along dim 0 (``True``) and which every piece gets whole (``False``: a per-class weight, a shared
            prompt). ``None``: every tensor is cut (one whose dim 0 matches the batch's only by chance too).
        batchnorm: ``"micro-batch"`` (BatchNorm's running statistics updated by every micro-batch, as
            Lightning) or ``"window"`` (updated once per window, with the statistics of all its samples pooled
            exactly, ``num_batches_tracked`` counting windows; each micro-batch is still normalised by its own
            statistics; a forward outside a micro-batch, as in an ``on_train_batch_end`` hook, is BatchNorm's own
            update). See the guide's "BatchNorm and accumulation".
        grad_accum_dtype: ``None`` (each window's gradient is summed in ``.grad``, in the parameters' dtype) or
            ``torch.float32`` (also ``"float32"`` / ``"fp32"``): under bf16 or fp16 parameters
            (``precision="bf16-true"``) each narrow parameter's window gradient is summed, normalised and all-reduced
            in float32 and rounded to its dtype once, for the step; between micro-batches its ``.grad`` is ``None``.
            Single device and DDP; see the guide's "The window's precision".

    Example:

        >>> import lightning.pytorch as pl
        >>> from lightning_accum import AccumulationScheduler, Ramp
        >>> ramp = Ramp(1, 8, over=50_000, unit="samples")
        >>> callback = AccumulationScheduler(ramp, lr_scaling="sqrt")
        >>> trainer = pl.Trainer(callbacks=[callback], logger=False)
    """

    def __init__(
        self,
        schedule: Schedule | int | Mapping[int, int] = 1,
        *,
        normalize: Normalize = "mean",
        count: Count | None = None,
        reduction: Reduction | None = None,
        lr_scaling: LRScaling | None = None,
        lr_schedule: LRMultiplier | None = None,
        log: bool = True,
        sync: SyncMode = "auto",
        microbatch_size: MicrobatchSize | None = None,
        split: Split | None = None,
        batchnorm: BatchNormMode = "micro-batch",
        grad_accum_dtype: torch.dtype | str | None = None,
    ) -> None:
        self.grad_accum_dtype = check_grad_accum_dtype(grad_accum_dtype)
        self.schedule = check_common("AccumulationScheduler", schedule, normalize, count, lr_scaling, sync, lr_schedule)
        self.normalize, self.reduction = normalize, check_callback_items(normalize, count, reduction)
        self.count = count
        self.lr_scaling, self.lr_schedule = lr_scaling, lr_schedule
        self._log = check_flag("log", log)  # not `self.log`: Lightning binds `log` on callbacks
        self.sync = sync
        self.microbatch_size = check_microbatch_size(microbatch_size)
        self.split = check_split(split, "`AccumulationScheduler`")
        if split is not None and microbatch_size is None:
            raise ValueError(
                "`split` says how `microbatch_size` cuts each loader batch, but `microbatch_size` is None (no batch is "
                "cut): give `microbatch_size` too, or leave `split` out."
            )
        self.batchnorm = check_batchnorm(batchnorm)
        if batchnorm == "window" and microbatch_size == "auto":
            raise ValueError(
                "`batchnorm='window'` with `microbatch_size='auto'` is not supported: a piece cut short by an "
                "out-of-memory error has run part of its forward, whose BatchNorm statistics cannot be told apart "
                "from the retried piece's. Give `microbatch_size` an int, or use `batchnorm='micro-batch'`."
            )
        self._engine = WindowEngine(
            self.schedule, normalize, lr_scaling, lr_schedule, self.reduction, grad_accum_dtype=self.grad_accum_dtype
        )
        self._budget = isinstance(self.schedule, Budget)  # windows closed by their count (`_steer_budget`)
        self._ahead = BudgetAhead()  # a budget's counts over ranks, read ahead from the loader
        # `batchnorm="window"`: the model's BatchNorm statistics, advanced by the engine with each window
        self._batchnorm = WindowBatchNorm() if batchnorm == "window" else None
        self._engine.pool_batchnorm(self._batchnorm)
        # `microbatch_size`: each loader batch's `training_step` run piece by piece (None: no split, no work)
        self._split = None if self.microbatch_size is None else Pieces(self.microbatch_size, self.split)
        self._unroute: Any = None  # gives the module its own `training_step` back
        self._closed = False  # the window was closed (its gradient all-reduced) before Lightning's step
        self._divisor = 1  # the trainer.accumulate_grad_batches value in force: where Lightning steps and zeroes
        # what Lightning divides each loss by: the window's k (its own loop's divisor), in force from `training_step`'s
        # return to the loss's backward; `_divisor` again after it (`_training_step`, `on_before_backward`)
        self._loss_divisor = 1
        self._dividing: pl.Trainer | None = None  # the trainer whose divisor is the loss divisor now
        self._partial = PartialWindow()  # a resumed window's part a checkpoint held
        self._strategy: Any = None
        self._fitting: pl.Trainer | None = None  # the fit being set up, till train start (its checkpoint checked)
        self._counters: Any = None  # Lightning's loop counters, of the fit (`_seam.LoopCounters`)
        # per fit
        self._optimizer: Optimizer | None = None
        self._counts: tuple[int, int | Tensor] = (0, 0)  # the batch being trained: (samples, items)
        self._redoing = False  # the batch being trained is one a checkpoint already holds
        # on each counted batch's loss: autograd tells the engine that its backward pass ran to its end, before any
        # `on_after_backward` (a closure: made at train start, so that the callback pickles for spawned ranks)
        self._pass_hook: Any = None
        self._prefix_due = False  # the noise probe's prefix after the batch under way is this hook's to take still
        self._batch_idx = 0
        self._frequencies = _seam.SchedulerFrequencies()
        self._lr_hook: RemovableHandle | None = None
        # what holds for one backward pass (sync skipped, hooks) or a step that moves nothing, till its end
        self._pass = contextlib.ExitStack()
        self._holding = False  # whether `_pass` holds anything (closing an empty one costs on the hot path)
        # on each loss's gradient, before any parameter sees it: Lightning's divisor over the window's (k), or
        # under DeepSpeed each micro-batch's whole weight
        self._loss_factor = 1.0
        self._deepspeed = self._sharded = False  # the plan's family, read once per fit for the hot path
        # DDP's sync skipped for every batch, the window's gradient all-reduced by the callback at its last batch
        # (`microbatch_size`, or `grad_accum_dtype`'s wide sums, which DDP's reducer cannot see); and whether the
        # plain path holds the skip for the batch under way itself
        self._reduces = self._blocks = False
        self._groups: tuple[int, ...] = ()  # the optimizer's param groups' sizes the wide sums were taken for
        self._user_divisor: int | None = None  # the Trainer's accumulate_grad_batches before this fit
        self._trained = False
        self._uncount = False  # whether Lightning is taking a step that moves nothing, which it counts
        self._plan = SyncPlan()  # the fit's
        self._readers = reporting.Readers.of_nobody()  # who reads the windows' numbers (found at train start)
        self._wants = reporting.NOTHING  # what the closing window must compute for them
        self._reported = reporting.Reported()  # the last window's numbers, for monitors after a resume
        self._behind: Any = None  # the last stepped window, where not all its numbers were published (a Closing)
        self._restored = False  # whether this fit's checkpoint restored the window
        # the hot path: a fit whose micro-batches are counted and nothing else (no split, DeepSpeed, shards, mean
        # weighting or noise probe), and whether the batch now under way is one such in a window whose losses
        # reach backward as Lightning divides them (then the next batch of the window takes the short hooks)
        self._plain = False
        self._lean = False

    @property
    def progress(self) -> Progress:
        """How far training has come: optimizer steps, samples and items over all ranks, epoch."""
        return self._engine.progress

    # ------------------------------------------------------------------ checks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Note the fit being set up, so that a checkpoint it resumes from that holds part of a window is checked
        as it loads (another number of ranks: refused before anything of it is restored)."""
        self._fitting = trainer if stage == "fit" else None  # (a checkpoint validated elsewhere is not refused)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._user_divisor = trainer.accumulate_grad_batches  # what teardown gives back
        fit_checks.refuse_scheduler_misuse(self, trainer, pl_module, decay_type=GradientDecay)
        plan = sync.loop_plan(trainer.strategy, self.sync, _seam.loop_skips_sync(trainer.strategy))
        self._deepspeed, self._sharded = plan.family == "deepspeed", plan.sharded
        fit_checks.refuse_split_misuse(self.microbatch_size, trainer, pl_module, plan)
        refuse_under(plan.family, self.grad_accum_dtype, "AccumulationScheduler")
        self._plan = plan
        if not self._restored:  # a fit not resumed from a checkpoint continues no window an earlier fit left open
            self._engine.discard()  # (one that failed inside it; Lightning zeroes the gradients before training)
            self._partial.forget()
            self._reported.clear()  # (nor shows an earlier fit's numbers)
            if self._split is not None:
                self._split.fresh_fit()
        self._restored = False
        check_noise_under(plan, self.schedule, self.lr_scaling)
        if self._batchnorm is not None:
            self._batchnorm.attach(pl_module)
        self._engine.widen(gradients.optimizer_params(trainer.optimizers[0]))
        self._groups = gradients.group_sizes(trainer.optimizers[0])  # (a group added later is taken as it joins)
        if self.grad_accum_dtype is not None and not self._engine.widened:
            rank_zero_warn(inert_note(self.grad_accum_dtype))
        self._set_reduces()

    def _set_reduces(self) -> None:
        """Whether the callback all-reduces each window's gradient itself under DDP (every batch's sync skipped):
        with ``microbatch_size``, or where ``grad_accum_dtype`` keeps sums DDP's reducer cannot see."""
        self._reduces = self._plan.family == "ddp" and (self._split is not None or self._engine.widened)
        self._blocks = self._reduces and self._split is None

    # ------------------------------------------------------------------ fit lifetime
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after checkpoint restore: put back the divisor Lightning's loop state was saved with
        set_divisor(trainer, self._divisor)
        _seam.resume_after_finished_epoch(trainer)
        self._optimizer, self._strategy, self._fitting = trainer.optimizers[0], trainer.strategy, None
        for decay in (cb for cb in trainer.callbacks if isinstance(cb, GradientDecay)):  # type: ignore[attr-defined]
            decay.keep_wide(self._engine.wide_sums)  # (before its own train start: it comes after this callback)
        self._counters = _seam.LoopCounters(trainer)
        numbers = self._partial.numbers(trainer.strategy, trainer.global_rank, trainer.ckpt_path)  # resumed in a window
        if numbers is not None:
            self._engine.load_local_numbers(numbers)
        self._frequencies = _seam.SchedulerFrequencies(trainer)
        self._trained = False  # whether this fit trained a batch yet
        self._lean = False
        self._plain = self._is_plain()
        self._pass_hook = self._pass_mark(trainer)
        steps.warn_scheduler_horizons(trainer)
        fit_checks.refuse_uneven_budget_data(trainer, self.schedule, "AccumulationScheduler")
        self._find_readers(trainer)
        self._reported.restore(trainer)
        if self.lr_scaling is not None or self.lr_schedule is not None:
            self._lr_hook = self._optimizer.register_step_post_hook(lambda *_: self._engine.restore_lr())
        if self._split is not None:
            self._attach_pieces(trainer, pl_module)
        else:
            self._unroute = _seam.route_training_step(pl_module, functools.partial(self._routed(), trainer))
        if self._budget:
            self._ahead.start(trainer)

    def _is_plain(self) -> bool:
        """Whether the fit's micro-batches are counted and nothing else (the hooks' short path, ``_lean``)."""
        return (
            not self._budget  # (each batch of a budget's window asks whether it closes it)
            and self._split is None
            and not (self._deepspeed or self._sharded)
            and self.reduction != "mean"
            and self._engine.probe is None
            and self.grad_accum_dtype is None  # (the parameters it sums in float32 may change at a window's opening)
        )

    def _pass_mark(self, trainer: pl.Trainer) -> Any:
        """The pre-hook put on each counted loss's ``grad_fn`` by which autograd marks its backward pass's end
        (``_seam.at_pass_end``), where something can raise between that end and this callback's
        ``on_after_backward`` (``recovery.pass_end_may_raise``); ``None`` where nothing can: there
        ``on_after_backward`` marks it (a closure made at train start, so that the callback pickles for spawned
        ranks)."""
        if not recovery.pass_end_may_raise(trainer, self):
            return None
        return _seam.at_pass_end(self._engine.pass_ended)

    def _find_readers(self, trainer: pl.Trainer) -> None:
        """Who reads the windows' numbers (``reporting.Readers``), with a warning for a reader Lightning calls
        before this callback at a batch's end; the engine keeps each loss only where someone reads them."""
        self._readers = reporting.Readers.of(trainer, self._log, reporting.listeners(trainer), own=self)
        self._behind = None
        early = reporting.readers_before(trainer, self) if self._log else []
        if early:
            rank_zero_warn(
                f"{', '.join(early)} come(s) before AccumulationScheduler in `Trainer(callbacks=...)` and define(s) "
                "`on_train_batch_end`: Lightning calls them first, so at a window's last batch they find the window "
                "before it in `trainer.callback_metrics`. List AccumulationScheduler before them, or read each "
                "window in `on_window_end(trainer, pl_module, window)`."
            )
        self._engine.start_fit(self._plan, track=self._readers.any)

    def _attach_pieces(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``microbatch_size``: Lightning's ``training_step`` calls go to the pieces until the fit ends."""
        assert self._split is not None and self._optimizer is not None
        fit = Fit(
            module=pl_module,
            precision=trainer.precision_plugin,
            scaler=grad_scaler(trainer),
            strategy=trainer.strategy,
            plan=self._engine.plan,
            optimizer=self._optimizer,
            normalize=self.normalize,
            mean_items=self.reduction == "mean",
            count=self.count,
            put_back=self._put_back,
            piece_done=None if self._batchnorm is None else self._batchnorm.hold,
            one_update=None if self._batchnorm is None else self._batchnorm.one_update,
            wide=self._engine.wide_sums,
        )
        self._split.attach(fit)
        split, routed = self._split, self._routed()
        self._unroute = _seam.route_training_step(
            pl_module, lambda *args, **kwargs: routed(trainer, split.step, *args, **kwargs)
        )

    def _routed(self) -> Any:
        """What Lightning's ``training_step`` calls go to (``batchnorm="window"``: a ``None`` return counted too)."""
        if self._batchnorm is not None:
            return self._training_step_pooled
        if self._split is None and self.grad_accum_dtype is None:  # (nothing widened, no sync held by the callback)
            return self._training_step_plain
        return self._training_step

    def _training_step(self, trainer: pl.Trainer, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``training_step`` call: Lightning divides what it returns by ``accumulate_grad_batches``,
        read as it returns, so that value is the window's k till the loss's backward (an unaligned window steers
        Lightning's stepping with another: ``_open``), and the loss every hook and callback sees is Lightning's own."""
        if self._engine.wide is not None and self._optimizer is not None:  # (`grad_accum_dtype`)
            sizes = gradients.group_sizes(self._optimizer)
            if sizes != self._groups:  # a param group joined inside a window (`BaseFinetuning`): its sums too
                self._groups = sizes
                self._engine.widen(gradients.optimizer_params(self._optimizer))
                self._set_reduces()
                if self._split is not None:
                    self._split.rewiden(self._engine.wide_sums)
        if self._blocks:  # (inside DDP's forward, which reads the flag after `training_step` returns)
            self._release()
            self._pass.enter_context(trainer.strategy.block_backward_sync())  # type: ignore[attr-defined]
            self._holding = True
        return self._training_step_plain(trainer, step, *args, **kwargs)

    def _training_step_plain(self, trainer: pl.Trainer, step: Any, *args: Any, **kwargs: Any) -> Any:
        """``_training_step`` where nothing is widened and no batch runs under a sync the callback holds (no
        ``microbatch_size``, no ``grad_accum_dtype``): Lightning's divisor, and nothing else."""
        output = step(*args, **kwargs)
        if self._loss_divisor != self._divisor and output is not None:  # (None: nothing divided, no backward)
            set_divisor(trainer, self._loss_divisor)
            self._dividing = trainer
        return output

    def _training_step_pooled(self, trainer: pl.Trainer, step: Any, *args: Any, **kwargs: Any) -> Any:
        """``_training_step`` under ``batchnorm="window"``: a ``training_step`` that returns ``None`` (the batch's
        backward skipped, or its first piece's) ran its forwards in training mode, whose statistics join the
        window as it returns, once (not a batch trained again, counted in its first run)."""
        output = self._training_step(trainer, step, *args, **kwargs)
        if output is None and not self._redoing:
            self._engine.ran_without_backward()
        return output

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(trainer)
        self._ahead.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning runs checkpoint callbacks' `on_exception` after this one: leave the state (and the optimizer
        # whose gradient a checkpoint saves) as a checkpoint written now must hold to resume exactly
        if self._dividing is not None:  # (raised between `training_step`'s return and its loss's backward)
            set_divisor(trainer, self._divisor)
            self._dividing = None
        self._release()
        self._uncount = False
        self._engine.restore_lr()
        if self._optimizer is not None:
            processed, in_backward = recovery.where(trainer, exception)
            open_pass = False
            if self._split is not None and not self._split.whole:  # (the pieces' own backward passes: Lightning's
                in_backward, open_pass = self._settle_pieces(trainer)  # reaches no parameter)
            elif self._split is not None:
                self._split.release()
            if self._prefix_due and self._engine.backward_finished and not in_backward:
                self._take_prefix(trainer)  # (the pass ended, but a hook before this one's `on_after_backward` raised)
            batch = (trainer.current_epoch, self._batch_idx)
            recovery.settle(self._engine, batch, processed=processed, in_backward=in_backward, open_pass=open_pass)
        optimizer = self._optimizer
        self._teardown(trainer)
        self._optimizer = optimizer
        # (the loader's state as without the reading ahead stays for the checkpoint callbacks' `on_exception` after
        # this one; the counts read ahead go)
        self._ahead.forget()

    def _settle_pieces(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """After an exception with ``microbatch_size``: whether a piece's backward was cut short (part of it is
        in the gradient), and whether pieces of the uncounted batch are in the gradient for good."""
        split = self._split
        assert split is not None
        split.release()
        split.restore_aside()  # (Lightning's zeroing in between: the gradient goes back to `.grad`)
        in_backward, open_pass = split.in_backward, False
        if not self._redoing and self._engine.inflight is None and not _seam.batch_processed(trainer):
            where = (trainer.current_epoch, self._batch_idx)
            open_pass = split.cut_short(where, single=trainer.world_size == 1)
            if split.resume is not None and split.resume[:2] == where:  # its finished pieces kept in the gradient:
                self._engine.keep_finished_pieces()  # their BatchNorm statistics in the window too
        split.batch_done()
        return in_backward, open_pass

    def _teardown(self, trainer: pl.Trainer) -> None:
        """Leave the Trainer, the model's sync flags and the LR scheduler configs as the user made them."""
        self._release()
        self._closed = self._lean = self._prefix_due = False
        self._pass_hook = None
        self._dividing = None  # (the user's divisor goes back below)
        if self._unroute is not None:
            self._unroute()
            self._unroute = None
        if self._split is not None:
            self._split.detach()
        if self._user_divisor is not None:
            set_divisor(trainer, self._user_divisor)
            self._user_divisor = None
        self._frequencies.restore()
        self._engine.restore_lr()
        if self._lr_hook is not None:
            self._lr_hook.remove()
            self._lr_hook = None
        self._optimizer = None
        self._engine.unwiden()
        if self._batchnorm is not None:
            self._batchnorm.detach()

    # ------------------------------------------------------------------ one window
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._lean:  # (a plain window's next batch: counted, nothing else; cleared as a window ends)
            samples = sample_count(batch, self._engine.samples_needed_by)
            self._counts = (samples, samples if self.count is None else self.count(batch))
            self._batch_idx = batch_idx
            if self._batchnorm is not None:  # (its forwards pooled till its backward ends, or the batch does)
                self._batchnorm.arm()
            return
        engine = self._engine
        if not self._trained:  # (the first batch after a resume: where Lightning's counters go off)
            _seam.keep_progress_consistent(trainer)
            self._trained = True
        if engine.window is None:
            if _seam.backward_skipped(trainer):  # e.g. StochasticWeightAveraging's BatchNorm epoch
                self._forward_only()
                return
            self._open(trainer, batch_idx)
        engine.batch_start()  # (`batchnorm="window"`: its forwards pooled till its backward ends, or the batch does)
        # a batch whose gradient a checkpoint already holds (saved by an exception after its backward) adds nothing
        self._redoing = engine.redo is not None and engine.redo == (trainer.current_epoch, batch_idx)
        # counted now, before `training_step` can change the batch (e.g. `labels = batch.pop("labels")`)
        self._counts = self._count(batch)
        self._batch_idx = batch_idx
        if self._budget:  # (before Lightning decides, after this hook, whether the batch steps)
            self._steer_budget(trainer, batch_idx)
        self._lean = takes_short_hooks(
            self._plain, self._loss_factor, self._loss_divisor, self._divisor, engine.redo, self._partial.pending
        )
        if self._deepspeed:
            sync.deepspeed_boundary(trainer.strategy, self._closes_window(trainer))
        if self._split is not None:
            self._begin_pieces(trainer, batch_idx)

    def _forward_only(self) -> None:
        """A batch of an epoch whose backward Lightning skips (``StochasticWeightAveraging``'s BatchNorm epoch): no
        window, Lightning's own stepping; its forwards update BatchNorm themselves."""
        if self._split is not None:
            self._split.begin_forward_only()
        if self._batchnorm is not None:
            self._batchnorm.suspend()

    def _begin_pieces(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """``microbatch_size``: the loader batch's pieces, told what the window and Lightning do with it."""
        assert self._split is not None
        self._split.begin(
            (trainer.current_epoch, batch_idx),
            self._counts[1],
            final=self._closes_window(trainer),
            zeroes_after=_seam.zeroes_after_training_step(trainer, batch_idx),
            redoing=self._redoing,
            divisor=self._loss_divisor,
            factor=self._loss_factor,
        )

    def _count(self, batch: Any) -> tuple[int, int | Tensor]:
        """A batch's samples and items (a count that is no one number is refused now, before any forward: a tensor's
        shape needs no host read)."""
        cut = self._split.length(batch) if self.split is not None and self._split is not None else None
        return batch_counts(batch, self._engine.samples_needed_by, self.count, cut)  # (cut: the rows of what is cut)

    def _steer_budget(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """Under a ``Budget``: whether this batch closes the window (its count summed over ranks, against the budget
        the window opened with), and Lightning's step point set to match: ``accumulate_grad_batches`` is
        ``batch_idx + 1`` (it steps after this batch) or ``batch_idx + 2`` (it does not), neither of which zeroes a
        batch but the window's first, where the callback zeroes itself if Lightning does not."""
        engine = self._engine
        window = engine.window
        assert window is not None
        total = None
        if not self._redoing:  # (its count over ranks read ahead: no meeting of the ranks here, `BudgetAhead`)
            total = self._ahead.total(
                trainer,
                batch_idx,
                lambda: engine.budget_count(*self._counts, warn=False),
                lambda batch: engine.budget_count(*self._count(batch)),
            )
            self._ahead.check(batch_idx, *self._counts, engine.schedule.unit == "samples")
        closes = engine.closes_after(*self._counts, self._strategy, again=self._redoing, total=total)
        divisor = batch_idx + 1 if closes else batch_idx + 2
        if divisor != self._divisor:
            set_divisor(trainer, divisor)
            self._divisor = divisor
        if batch_idx == window.start and not window.microbatches and batch_idx % divisor:
            assert self._optimizer is not None  # the window's first batch, which Lightning will not zero
            zero_grad_like_lightning(trainer, batch_idx, self._optimizer)

    def _open(self, trainer: pl.Trainer, batch_idx: int) -> None:
        if self.grad_accum_dtype is not None and self._rewiden():  # (a param group added, a layer unfrozen)
            self._set_reduces()
            if self._split is not None:
                self._split.rewiden(self._engine.wide_sums)
        window = self._engine.open(trainer.current_epoch, batch_idx, self._strategy)
        if self._batchnorm is not None:
            self._batchnorm.resume()
        if window.budget is not None:  # (the step point and the zeroing: `_steer_budget`, once the count is known)
            self._loss_divisor, self._loss_factor = 1, 1.0  # each loss as it is; divided at the close
            if self._split is not None:
                self._split.forget_window()
            return
        divisor = lightning_divisor(batch_idx, window.k)
        if divisor != self._divisor:  # (in force since train start, or set by an earlier window)
            set_divisor(trainer, divisor)
            self._divisor = divisor
        if batch_idx % self._divisor:  # Lightning will not zero this window's first batch: do it
            assert self._optimizer is not None
            zero_grad_like_lightning(trainer, batch_idx, self._optimizer)
        # Lightning divides each loss by k (`_training_step`); under DeepSpeed each micro-batch's whole weight is put
        # on the loss's gradient
        self._loss_divisor = window.divisor
        if self._deepspeed:
            length = sync.deepspeed_window_length(trainer.num_training_batches, batch_idx, window.k)
        else:
            length = window.divisor
        self._loss_factor = self._loss_divisor / length
        if self._split is not None:
            self._split.forget_window()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._lean:  # (what the long path below comes to for a plain batch)
            samples, items = self._counts
            self._engine.count(samples, items)
            if self._pass_hook and (node := loss.grad_fn) is not None:
                node.register_prehook(self._pass_hook)
            if self._engine.metrics.tracking:
                self._engine.metrics.add_loss(loss, factor=self._loss_divisor)
            return
        if self._dividing is not None:  # (Lightning read it: its stepping divisor back, before its next read)
            set_divisor(self._dividing, self._divisor)
            self._dividing = None
        engine = self._engine
        if engine.window is None:
            return
        if self._split is not None and not self._split.whole:
            self._count_pieces(trainer, loss)
            return
        if self._partial.pending:  # (after any zeroing of this batch)
            self._put_back()
        if not self._shape_pass(trainer, loss):
            return  # (a batch trained again: in the window already)
        engine.count(*self._counts)
        # autograd marks the pass's end: a callback listed before this one that raises in `on_after_backward` leaves
        # the batch's gradient in `.grad`, and the batch in the window (trained again, it adds nothing)
        if (hook := self._pass_hook) is not None and (node := loss.grad_fn) is not None:
            node.register_prehook(hook)
        self._prefix_due = engine.probe is not None
        if engine.metrics.tracking:  # the loss as `training_step` returned it (Lightning divided it by k)
            mean = self.reduction == "mean"
            engine.metrics.add_loss(weigh(loss, self._counts[1]) if mean else loss, factor=self._loss_divisor)

    def _shape_pass(self, trainer: pl.Trainer, loss: Tensor) -> bool:
        """What holds for the batch's backward pass (in ``_pass``, till its end): nothing added where the batch is in
        the window already (returns ``False``: it is not counted) or is a mean over no items; its loss's gradient
        weighted; FSDP's sync skipped unless the batch closes the window."""
        engine = self._engine
        mean = self.reduction == "mean"  # a mean over the micro-batch's items: weighted by their count
        # in the window already, or a mean over no items (NaN): the pass adds nothing (for a tensor count,
        # decided on the device)
        nothing = True if self._redoing else gradients.no_items(self._counts[1]) if mean else False
        if nothing is not False:
            assert self._optimizer is not None
            for handle in gradients.add_nothing_if(gradients.optimizer_params(self._optimizer), nothing):
                self._pass.callback(handle.remove)
            self._holding = True
            if self._redoing:
                return False
        if mean or self._loss_factor != 1.0:  # (the hot path of an aligned window: nothing to scale)
            factor = self._loss_factor * self._counts[1] if mean else self._loss_factor
            if engine.widened:  # (`grad_accum_dtype`: weighted in the wide dtype as each gradient is taken)
                self._pass.enter_context(engine.wide.weighting(factor))  # type: ignore[union-attr]
                self._holding = True
            else:
                sync.scale_backward(loss, factor)
        if self._sharded:  # FSDP reads its sync flag in backward: skip it unless this batch closes the window
            assert engine.window is not None
            final = self._closes_window(trainer)
            self._pass.enter_context(sync.skip_sync(engine.plan, trainer.strategy, final))
            self._holding = True
            engine.window.mark_synced(final)
        return True

    def _count_pieces(self, trainer: pl.Trainer, loss: Tensor) -> None:
        """``microbatch_size``: the pieces' backward passes ran in ``training_step``; Lightning's, of ``loss``, adds
        nothing. The loader batch counts once, as one micro-batch of the window, and its gradient is in."""
        assert self._split is not None and self._engine.window is not None
        self._split.restore_aside()  # (after Lightning's zeroing of a window's first batch)
        if self._redoing:
            return
        engine = self._engine
        if self._sharded:  # the window's last piece synced
            self._engine.window.mark_synced(self._closes_window(trainer))
        engine.count(*self._counts)
        if engine.metrics.tracking:
            mean = self.reduction == "mean"
            engine.metrics.add_loss(weigh(loss, self._counts[1]) if mean else loss, factor=self._loss_divisor)
        engine.backward_done()
        # the batch's gradient is in the window from here on (a failure before `on_after_backward` leaves it there, and
        # the batch, trained again, adds nothing): the noise probe's prefix after it is taken now, with it
        self._take_prefix(trainer)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._lean:
            self._engine.backward_done()
            return
        if self._holding:
            self._release()
        self._prefix_due = False
        engine = self._engine
        if self._split is not None:
            self._split.release()  # (DDP's sync back on)
        if self._reduces and engine.window is not None and self._closes_window(trainer):
            # every backward pass ran without DDP's sync: the window's gradient is all-reduced here, once
            assert self._optimizer is not None  # (before AMP's unscaling, which then sees the global gradient)
            engine.close_and_reduce(trainer.strategy, gradients.optimizer_params(self._optimizer))
            self._closed = True
        engine.backward_done()
        if self._split is None or self._split.whole:  # (a batch in pieces: taken as it was counted, `_count_pieces`)
            self._take_prefix(trainer)

    def _take_prefix(self, trainer: pl.Trainer) -> None:
        """Noise probe: the window's gradient after the batch just counted and back-propagated, where the probe
        measures (micro-batches 1, 4, 16, ... of the window, not its last)."""
        engine = self._engine
        if engine.probe is None or not engine.wants_prefix() or self._optimizer is None or self._redoing:
            return
        if self._closes_window(trainer):
            return  # this micro-batch closes the window: its gradient is already the window's (and synced)
        engine.measure_prefix(gradients.optimizer_grads(self._optimizer), loss_scale(trainer))

    def _closes_window(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning steps after the batch being trained (the seam aligns its step points)."""
        window = self._engine.window
        assert window is not None
        if window.budget is not None:  # (decided as the batch started: `_steer_budget`)
            return window.ends or _seam.epoch_ends_after_this_batch(trainer)
        return self._batch_idx >= window.start + window.k - 1 or _seam.epoch_ends_after_this_batch(trainer)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        engine = self._engine
        if engine.window is None:
            if _seam.backward_skipped(trainer):  # SWA's BatchNorm epoch: Lightning would step with a stale gradient
                self._move_nothing(trainer, optimizer)
            return
        if self._deepspeed and not self._closes_window(trainer):
            return  # Lightning calls DeepSpeed's `engine.step()` after every batch; it steps at the boundary only
        if self._partial.pending:  # (where the window's batches since the resume ran no backward: `None` losses)
            self._put_back()
        step = self._counters.steps.completed + 1  # (the step this window makes, as the loggers and `max_steps` count)
        # (only where nobody reads every window does it matter whether this one is the epoch's or the fit's last)
        last = self._readers.asks_last and self._counters.last_window(step, self._batch_idx)
        self._wants = self._readers.wants(step, last)
        closing = self._close(trainer, optimizer)
        if closing.empty:  # nothing went in: leave the parameters and the optimizer's state as they are
            self._move_nothing(trainer, optimizer)
        # (under DeepSpeed each micro-batch was weighted before its backward)
        elif not self._deepspeed and (
            closing.scale != 1.0 or engine.probe is not None or self._closed or engine.widened
        ):
            self._rescale(trainer, optimizer, closing)
        engine.scale_lr(optimizer, keep=self._log)  # (the rates stepped with, for a report: any window may be one)
        if self._frequencies.saved:  # (step-interval schedulers: Lightning steps them where this window steps)
            self._frequencies.before_step(engine.progress.step + 1, self._batch_idx, stepped=not closing.empty)

    def _close(self, trainer: pl.Trainer, optimizer: Optimizer) -> Any:
        """The window's closing (``WindowEngine.close``): its counts over ranks read, its gradient's scale and LR
        factor, and its numbers for the readers (``_wants``)."""
        engine, wants = self._engine, self._wants
        if self._closed:  # (closed and all-reduced after the window's last backward: `microbatch_size` under DDP)
            assert engine.closing is not None
            return engine.closing
        if self._reduces:  # (the window's last batch ran no backward: its gradient is all-reduced here)
            self._closed = True
            return engine.close_and_reduce(trainer.strategy, gradients.optimizer_params(optimizer))
        # the gradient is the window's (and global) but for its scale: its norm is measured in the counts' read
        # (where it is read; not DeepSpeed's, which holds its own, nor a shard's, whose norm is not the window's)
        measured = (wants.norm or engine.probe is not None) and not (self._deepspeed or self._sharded)
        grads = gradients.optimizer_grads(optimizer) if measured else None
        return engine.close(self._strategy, grads=grads, losses=wants.losses, norm=wants.norm)

    def _rescale(self, trainer: pl.Trainer, optimizer: Optimizer, closing: Any) -> None:
        """The window's gradient scaled for its step (``grad_accum_dtype``: the wide sums landed in ``.grad``), and
        measured where the noise probe or a reader asks."""
        engine = self._engine
        grads = gradients.optimizer_grads(optimizer)
        gradients.scale_(grads, closing.scale)
        if engine.widened:  # (the narrow parameters' sums, normalised and rounded once, into `.grad` beside)
            engine.land(closing.scale)
            grads = gradients.optimizer_grads(optimizer)
        if engine.probe is not None:  # (the noise probe's window end)
            engine.measure_window(trainer.strategy, grads)
        if self._closed and closing.norm_sq is None and self._wants.norm:
            engine.metrics.add_grad_norm(grads)

    def _put_back(self) -> list[Tensor | None] | None:
        """Resumed inside a window: its partial gradient into `.grad`, once, at the first backward pass or step
        after the resume (after any zeroing of its next batch); returns it (``None`` if nothing waited)."""
        if not self._partial.pending or self._optimizer is None:
            return None
        return self._partial.put_back(gradients.optimizer_params(self._optimizer), self._engine.wide_sums)

    def _rewiden(self) -> bool:
        return self._optimizer is not None and self._engine.rewiden(gradients.optimizer_params(self._optimizer))

    def _release(self) -> None:
        """End what `_pass` holds."""
        if self._holding:
            self._pass.close()
            self._holding = False

    def _move_nothing(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """Make the step Lightning is taking move nothing (no gradient, no clipping) and not count."""
        for p in gradients.optimizer_params(optimizer):
            p.grad = None
        self._pass.callback(_seam.suspend_clipping(trainer))  # (till the batch's end)
        self._holding = True
        self._uncount = not self._deepspeed

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        engine.batch_done()
        if self._lean and engine.closing is None:
            return
        if not self._lean or self._holding:  # (a short batch's only leftover: a step that moved nothing)
            self._batch_over(trainer, outputs)
        if engine.closing is None:
            return
        self._lean = False  # (the window's next batch opens one)
        if self._split is not None:
            self._split.forget_window()  # (the batches kept to redo it after an out-of-memory error)
        if self._lr_hook is not None:  # (else no rate was scaled)
            engine.restore_lr()  # normally done by the optimizer's post-step hook already
        closing = engine.advance(trainer.current_epoch)
        if closing.empty:
            return
        if self._wants is reporting.NOTHING:  # (nothing read: the window kept, in case the fit stops after it)
            self._behind = closing if self._log else None
            return
        self._publish(trainer, pl_module, closing)

    def _batch_over(self, trainer: pl.Trainer, outputs: Any) -> None:
        """What held for the batch ends: the loss in ``outputs`` as Lightning's, clipping back on, the pieces done,
        and a step that moved nothing uncounted."""
        if self._engine.widened:  # Lightning divided the loss by the power of two at or above k: `outputs` over k
            _over_k(outputs, self._engine.window)
        if self._holding:  # (after a step that moved nothing: clipping back on)
            self._release()
        self._closed = False
        if self._split is not None:
            self._split.release()  # (a batch whose `training_step` returned None had no backward)
            self._split.batch_done()
        if self._uncount:  # Lightning counted the step that moved nothing
            _seam.uncount_step(trainer)
            self._uncount = False

    def _publish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, closing: Any) -> None:
        """The stepped window's numbers to those who read them (``_wants``): ``callback_metrics`` and the loggers,
        the ``on_window_end`` hooks, or the progress bar's ``k`` and loss."""
        wants = self._wants
        # (a window not published whole, kept till the next: if the fit stops after it, it is published then)
        self._behind = None if (wants.publish and wants.keys is None) or not self._log else closing
        if wants.publish or wants.hooks:
            size = None if self._split is None else self._split.used
            configs = trainer.lr_scheduler_configs
            window = reporting.report(
                trainer.optimizers, self._engine, closing, microbatch_size=size, schedulers=configs
            )
            if wants.publish:
                self._reported.publish(trainer, window, wants=wants)
            reporting.announce(self._readers.hooks, trainer, pl_module, window)
        elif wants.bar:
            reporting.show(trainer, closing.k, None if closing.losses is None else closing.losses.get("loss"))

    def _report(self, trainer: pl.Trainer, closing: Any) -> reporting.WindowReport:
        size = None if self._split is None else self._split.used
        configs = trainer.lr_scheduler_configs
        return reporting.report(trainer.optimizers, self._engine, closing, microbatch_size=size, schedulers=configs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fit stopped after a window that was not published whole (`trainer.should_stop`, e.g. by `EarlyStopping`,
        # between the loggers' steps): its numbers are the fit's latest
        if self._behind is not None:
            self._reported.publish(trainer, self._report(trainer, self._behind))
            self._behind = None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._optimizer is not None and self._trained:  # (so the epoch's metrics are this fit's)
            _seam.step_plateau_after_resume(trainer)
        if self._engine.window is not None and self._engine.closing is None:
            # the loop was stopped inside a window (e.g. `trainer.should_stop`): nothing was stepped
            self._lean = False  # (the next batch opens a window)
            self._engine.discard()
            self._partial.forget()  # (nor is a resumed part of it put back into the next window)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """Progress, the open window (with its partial gradient, every rank's under DDP) and the last
        window's numbers: what a checkpoint needs to resume exactly, at a step or inside a window."""
        state = self._engine.state_dict()
        state["divisor"] = self._divisor
        state["reported"] = self._reported.state_dict()
        cut_short = False  # part of a batch in the window's gradient, not counted (an exception between pieces)
        if self._split is not None:
            state["pieces"] = self._split.state_dict()
            cut_short = self._split.resume is not None
        window = state["window"]
        if window is not None and (window["microbatches"] or cut_short) and self._optimizer is not None:
            # a checkpoint inside a window (e.g. at a mid-window validation) keeps the partial gradient
            params = gradients.optimizer_params(self._optimizer)
            engine = self._engine
            state.update(self._partial.save(self._strategy, engine.local_numbers(), params, engine.wide_sums))
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the partial gradient is put back at train start)."""
        if self._fitting is not None:  # (a partial window on another world size: refused before anything changes)
            self._partial.check(state_dict, self._fitting.strategy, self._fitting.ckpt_path)
        self._engine.load_state_dict(state_dict)
        self._restored = True  # (not before: a refused checkpoint restores nothing)
        self._divisor = int(state_dict.get("divisor", 1))
        self._reported.load_state_dict(state_dict.get("reported", {}))
        if self._split is not None:
            self._split.load_state_dict(state_dict.get("pieces", {}))
        self._partial.load(state_dict)
        window = self._engine.window
        self._loss_divisor = 1 if window is None else window.divisor
        self._loss_factor = 1.0
        if window is not None and window.microbatches and not self._partial.loaded:
            rank_zero_warn("The checkpoint was saved inside an accumulation window without its gradients.")


def _over_k(outputs: Any, window: Any) -> None:
    """Under ``grad_accum_dtype`` each loss went to backward divided by ``wide_divisor(k)``, the power of two at or
    above ``k``: the loss ``outputs`` hands the batch-end hooks is divided by the window's ``k`` instead, as without
    it (``(loss / p) * p`` is ``loss`` exactly, so this is Lightning's own ``loss / k``)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else None
    if window is not None and window.budget is None and window.divisor != window.k and isinstance(loss, Tensor):
        outputs["loss"] = loss * window.divisor / window.k


def takes_short_hooks(
    plain: bool, loss_factor: float, loss_divisor: int, divisor: int, redo: object, put_back_pending: bool
) -> bool:
    """Whether a batch of a plain fit (counted and nothing else) takes the hooks' short path: not where its loss's
    gradient is weighted (``loss_factor``), where Lightning's divisor must go back after its loss (``loss_divisor``
    is not the stepping ``divisor``), where a batch is to be trained again (``redo``) or a resumed window's gradient
    waits to be put back."""
    return plain and loss_factor == 1.0 and loss_divisor == divisor and redo is None and not put_back_pending
