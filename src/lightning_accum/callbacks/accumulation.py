"""``AccumulationScheduler``: exact, scheduled gradient accumulation in automatic optimization."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_accum import _seam, gradients, sync
from lightning_accum._lightning import (
    Callback,
    gradient_accumulation_schedulers,
    log_window,
    loss_scale,
    pl,
    rank_zero_warn,
)
from lightning_accum._seam import set_divisor, zero_grad_like_lightning
from lightning_accum.engine import WindowEngine
from lightning_accum.noise import check_noise_under
from lightning_accum.options import Count, LRScaling, check_common
from lightning_accum.schedules import Progress, Schedule
from lightning_accum.sync import SyncMode
from lightning_accum.window import Normalize, batch_size, lightning_divisor


class AccumulationScheduler(Callback):
    r"""Accumulate gradients over windows whose size follows a schedule, exactly.

    Each window holds the ``k`` micro-batches the schedule gave when it opened (changes apply
    from the next window, mid-epoch included; an epoch's last window may be short) and the
    stepped gradient is normalised by what really went in:

    * ``normalize="mean"``: the mean of the window's micro-batch gradients over all ranks, a
      short window included (Lightning's built-in divides a short window by the full ``k``);
    * ``normalize="items"``: ``training_step`` returns a *sum* over items (tokens, ...) and
      ``count(batch)`` gives the micro-batch's item count; the stepped gradient is the window's
      summed gradient over all ranks divided by its global item count (token-weighted mean).

    On DDP the gradients are all-reduced once per optimizer step. The rescale happens in
    ``on_before_optimizer_step``: after AMP unscaling, before gradient clipping. LR schedulers
    with ``interval="step"`` step once per optimizer step, and their ``frequency`` counts
    optimizer steps. ``lr_scaling`` multiplies every group's learning rate, for the step only,
    by ``k / k_first`` (``"linear"``) or its square root (``"sqrt"``).

    Args:
        schedule: a :class:`~lightning_accum.Schedule`, an ``int`` or an epoch-keyed ``dict``
            (as for Lightning's ``GradientAccumulationScheduler``).
        normalize: ``"mean"`` or ``"items"``.
        count: ``count(batch) -> int | Tensor``: items in a micro-batch; required for
            ``"items"``, optional otherwise (it feeds ``Progress.items``).
        lr_scaling: ``None``, ``"linear"`` or ``"sqrt"``.
        log: log ``accum/k`` (also in the progress bar), ``accum/effective_batch``,
            ``accum/samples`` and ``accum/items`` every ``Trainer(log_every_n_steps)`` optimizer
            steps (when the loggers are written) and at the first.
        sync: gradient sync inside a window on sharded strategies: ``"auto"`` (FSDP2: once per
            window; FSDP: every micro-batch, as Lightning), ``"skip"`` (once per window; FSDP and
            FSDP2 then hold unsharded gradients until its end) or ``"every"``. DDP always syncs
            once per window.

    Example::

        >>> from lightning_accum import AccumulationScheduler, Ramp
        >>> ramp = Ramp(1, 8, over=50_000, unit="samples")
        >>> callback = AccumulationScheduler(ramp, lr_scaling="sqrt")
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(
        self,
        schedule: Schedule | int | Mapping[int, int] = 1,
        *,
        normalize: Normalize = "mean",
        count: Count | None = None,
        lr_scaling: LRScaling | None = None,
        log: bool = True,
        sync: SyncMode = "auto",
    ) -> None:
        self.schedule = check_common("AccumulationScheduler", schedule, normalize, count, lr_scaling, sync)
        if normalize == "items" and count is None:
            raise ValueError(
                "`normalize='items'` needs `count`: a function giving each micro-batch's number of items, "
                "e.g. `count=lambda batch: int(batch['mask'].sum())`."
            )
        self.normalize = normalize
        self.count = count
        self.lr_scaling = lr_scaling
        self._log = log  # not `self.log`: Lightning binds `log` on callbacks
        self.sync = sync
        self._engine = WindowEngine(self.schedule, normalize, lr_scaling, divisor=lightning_divisor)
        self._divisor = 1  # the trainer.accumulate_grad_batches value in force
        self._saved_grads: list[Tensor | None] | None = None
        # per fit
        self._optimizer: Optimizer | None = None
        self._batch: Any = None
        self._batch_idx = 0
        self._lr_frequencies: list[tuple[Any, int]] = []
        self._lr_hook: RemovableHandle | None = None
        self._no_sync = contextlib.ExitStack()  # open from on_before_backward to on_after_backward
        self._loss_factor = 1.0  # DeepSpeed: each micro-batch's weight, applied before its backward
        self._deepspeed = self._sharded = False  # the plan's family, read once per fit for the hot path

    @property
    def progress(self) -> Progress:
        """How far training has come: optimizer steps, samples and items over all ranks, epoch."""
        return self._engine.progress

    # ------------------------------------------------------------------ checks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "`AccumulationScheduler` drives Lightning's automatic optimization, but this module sets "
                "`automatic_optimization = False`. For manual optimization use `lightning_accum.AccumulationMixin` "
                "and `self.configure_accumulation(...)` instead of the callback."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` and `AccumulationScheduler` "
                "both set the accumulation: remove `accumulate_grad_batches` from the Trainer and give the "
                f"callback the schedule, e.g. `AccumulationScheduler({trainer.accumulate_grad_batches})`."
            )
        others = [
            type(cb).__name__
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if cb is not self and isinstance(cb, (AccumulationScheduler, *gradient_accumulation_schedulers()))
        ]
        if others:
            raise ValueError(
                f"Only one accumulation callback can drive the Trainer; found {', '.join(others)} besides this "
                "`AccumulationScheduler`. Keep one (a dict schedule replaces `GradientAccumulationScheduler`)."
            )
        if self.normalize == "items":
            sync.refuse_deepspeed(trainer.strategy, "AccumulationScheduler", "(normalize='items')")
        if self.lr_scaling is not None:
            sync.refuse_deepspeed(trainer.strategy, "AccumulationScheduler", f"(lr_scaling={self.lr_scaling!r})")
        plan = self._engine.plan = sync.plan(trainer.strategy, self.sync)
        self._deepspeed, self._sharded = plan.family == "deepspeed", plan.sharded
        check_noise_under(plan, self.schedule)

    # ------------------------------------------------------------------ fit lifetime
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after checkpoint restore: put back the divisor Lightning's loop state was saved with
        set_divisor(trainer, self._divisor)
        self._optimizer = trainer.optimizers[0]
        if self._saved_grads is not None:
            gradients.restore(gradients.optimizer_params(self._optimizer), self._saved_grads)
            self._saved_grads = None
        self._lr_frequencies = [
            (config, config.frequency)
            for config in trainer.lr_scheduler_configs
            if config.interval == "step" and config.frequency > 1
        ]
        if self.lr_scaling is not None:
            self._lr_hook = self._optimizer.register_step_post_hook(lambda *_: self._engine.restore_lr())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown(trainer)

    def _teardown(self, trainer: pl.Trainer) -> None:
        """Leave the Trainer, the model's sync flags and the LR scheduler configs as the user made them."""
        self._no_sync.close()
        set_divisor(trainer, 1)
        for config, frequency in self._lr_frequencies:
            config.frequency = frequency
        self._lr_frequencies = []
        self._engine.restore_lr()
        if self._lr_hook is not None:
            self._lr_hook.remove()
            self._lr_hook = None
        self._optimizer = None
        self._batch = None

    # ------------------------------------------------------------------ one window
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._engine.window is None:
            self._open(trainer, pl_module, batch_idx)
        self._batch = batch
        self._batch_idx = batch_idx
        if self._deepspeed:
            sync.deepspeed_boundary(trainer.strategy, self._closes_window(trainer))

    def _open(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        window = self._engine.open(trainer.current_epoch, batch_idx)
        self._divisor = window.divisor
        set_divisor(trainer, self._divisor)
        if batch_idx % self._divisor:  # Lightning will not zero this window's first batch: do it
            assert self._optimizer is not None
            zero_grad_like_lightning(trainer, pl_module, batch_idx, self._optimizer)
        if self._deepspeed:
            self._loss_factor = self._divisor / self._window_length(trainer, batch_idx, window.k)

    @staticmethod
    def _window_length(trainer: pl.Trainer, start: int, k: int) -> int:
        """Micro-batches the window opening at ``start`` will hold: ``k``, or fewer at the epoch's end."""
        batches = trainer.num_training_batches
        if math.isinf(batches):
            raise RuntimeError(
                "Under DeepSpeed, `AccumulationScheduler` weights each micro-batch before backward, so it must know "
                "when the epoch ends: give the Trainer a dataloader with a length, or set `limit_train_batches`."
            )
        return min(k, int(batches) - start)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        window = self._engine.window
        if window is None:
            return
        if self._deepspeed:  # the engine holds the gradient: weight this micro-batch now
            sync.scale_backward(loss, self._loss_factor)
        if self._sharded:  # FSDP reads its sync flag in backward: skip it unless this batch closes the window
            final = self._closes_window(trainer)
            self._no_sync.enter_context(sync.skip_sync(self._engine.plan, trainer.strategy, final))
            window.synced = final
        samples = batch_size(self._batch)
        window.add(samples, samples if self.count is None else self.count(self._batch))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sharded:
            self._no_sync.close()
        engine, window = self._engine, self._engine.window
        if engine.probe is None or window is None or window.microbatches != 1 or self._optimizer is None:
            return
        if self._closes_window(trainer):
            return  # this micro-batch closes the window: its gradient is already the window's (and synced)
        engine.measure_first(gradients.optimizer_grads(self._optimizer), loss_scale(trainer))

    def _closes_window(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning steps after the batch being trained (the seam aligns its step points)."""
        window = self._engine.window
        assert window is not None
        return self._batch_idx >= window.start + window.k - 1 or _seam.epoch_ends_after_this_batch(trainer)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        engine = self._engine
        if engine.window is None:
            return
        deepspeed = self._deepspeed
        if deepspeed and not self._closes_window(trainer):
            return  # Lightning calls DeepSpeed's `engine.step()` after every batch; it steps at the boundary only
        closing = engine.close(trainer.strategy)
        # (under DeepSpeed each micro-batch was weighted before its backward)
        if not deepspeed and (closing.scale != 1.0 or engine.probe is not None):
            grads = gradients.optimizer_grads(optimizer)
            gradients.scale_(grads, closing.scale)
            engine.measure_window(trainer.strategy, grads)
        engine.scale_lr(optimizer)
        step = engine.progress.step + 1
        for config, frequency in self._lr_frequencies:
            # Lightning tests (batch_idx + 1) % frequency; make that true exactly every `frequency` steps
            config.frequency = 1 if step % frequency == 0 else self._batch_idx + 2

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine
        if engine.closing is None:
            return
        engine.restore_lr()  # normally done by the optimizer's post-step hook already
        closing = engine.advance(trainer.current_epoch)
        if self._log:
            every = trainer.log_every_n_steps  # type: ignore[attr-defined]
            log_window(pl_module, "accum/", every, closing, engine.progress, engine.noise_scale)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._engine.window is not None and self._engine.closing is None:
            # the loop was stopped inside a window (e.g. `trainer.should_stop`): nothing was stepped
            self._engine.discard()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = self._engine.state_dict()
        state.update(schedule=self.schedule.state_dict(), divisor=self._divisor)
        if state["window"] is not None and state["window"]["microbatches"] and self._optimizer is not None:
            # a checkpoint inside a window (e.g. at a mid-window validation) keeps the partial gradient
            state["grads"] = gradients.snapshot(gradients.optimizer_params(self._optimizer))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._engine.load_state_dict(state_dict)
        self.schedule.load_state_dict(state_dict.get("schedule", {}))
        self._divisor = int(state_dict.get("divisor", 1))
        self._saved_grads = state_dict.get("grads")
        window = self._engine.window
        if window is not None and window.microbatches and self._saved_grads is None:
            rank_zero_warn("The checkpoint was saved inside an accumulation window without its gradients.")
