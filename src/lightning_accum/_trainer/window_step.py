"""The mixin's window-end step: the gradient made global, the group's optimizers stepped (the
rescale, decay and clipping inside each ``optimizer.step()``, after AMP unscaling), their
step-interval LR schedulers stepped (``step_schedulers=True``), the gradients reset for the next
window, the window logged.

``WindowStep.close`` runs when the ``accumulate`` block of a window's last micro-batch exits;
``WindowStep.before_optimizer_step`` from the driver's ``on_before_optimizer_step`` inside each
optimizer's step. It is handed the engine, the optimizers and the parameters, not the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_accum._core import collectives, gradients
from lightning_accum._core.engine import WindowEngine
from lightning_accum._core.microbatch import AutoSize
from lightning_accum._core.options import AccumulationConfig
from lightning_accum._core.sync import SyncPlan
from lightning_accum._lightning import loss_scale
from lightning_accum._trainer import reporting
from lightning_accum._trainer.guards import MixinGuards
from lightning_accum._trainer.schedulers import MixinSchedulers


class WindowStep:
    """The window-end step of the mixin and what it holds while an optimizer steps.

    Attributes:
        rescaled: whether the closing window's gradient was changed in place for its step yet (what
            an exception then leaves cannot be resumed exactly).
    """

    def __init__(self) -> None:
        # id(optimizer) -> the window's gradient scale, its engine, and the ids of the parameters
        # rescaled so far (one held by two optimizers of the group is rescaled once)
        self._pending: dict[int, tuple[float, WindowEngine, set[int]]] = {}
        self.rescaled = False
        self.listeners: list[Any] = []  # other callbacks' `on_window_end`
        self.reported = reporting.Reported()  # the last windows' numbers, for monitors after a resume

    def start_training(self, trainer: Any) -> None:
        """At a fit's train start: the callbacks' ``on_window_end`` hooks to call after each step, and the
        last windows' numbers a checkpoint held back in ``trainer.callback_metrics``."""
        self.listeners = reporting.listeners(trainer)
        self.reported.restore(trainer)

    def close(
        self,
        trainer: Any,
        module: Any,
        key: tuple[int, ...],
        engine: WindowEngine,
        optimizers: Sequence[Any],
        params: Sequence[Tensor],
        *,
        config: AccumulationConfig,
        plan: SyncPlan,
        guards: MixinGuards,
        auto: AutoSize,
        schedulers: MixinSchedulers | None,
        log_prefix: str,
    ) -> None:
        """Make the window's gradient global, step ``optimizers`` (the group's, Lightning-wrapped) and, under
        ``step_schedulers=True`` (``schedulers``), their step-interval schedulers, reset, log."""
        strategy = trainer.strategy
        assert engine.window is not None
        world = collectives.world_size(strategy)
        if not engine.window.microbatches and world == 1:  # nothing went in: nothing to step
            if engine.batchnorm is not None:  # (but blocks without a pass ran forwards: their statistics count)
                engine.batchnorm.commit()
            engine.discard()
            return
        if world > 1 and plan.family == "ddp":
            closing = engine.close_and_reduce(strategy, params)
        else:  # single device, or FSDP's own (reduce-)scatter on the last micro-batch made the gradient global
            grads = None if plan.sharded else gradients.grads_of(params)  # (a shard's norm is not the window's)
            closing = engine.close(strategy, grads=grads, loss_scale=lambda: loss_scale(trainer))
        self.rescaled = False
        if closing.empty:  # nothing went in, over all ranks: no step (it would move Adam's state)
            with guards.resetting():
                _reset(config, optimizers, engine)
            engine.advance(trainer.current_epoch)
            return
        # the window's normalised gradient is `.grad * scale / loss scale`
        if engine.probe is not None:
            engine.measure_window(strategy, gradients.grads_of(params), closing.scale / loss_scale(trainer))
        rescaled: set[int] = set()
        for optimizer in optimizers:
            self._pending[id(optimizer.optimizer)] = closing.scale, engine, rescaled
            engine.scale_lr(optimizer)
            try:
                with guards.stepping():
                    optimizer.step()
            finally:
                engine.restore_lr()
            if self._pending.pop(id(optimizer.optimizer), None) is not None:
                raise RuntimeError(
                    "The window's gradient was not normalised: Lightning did not call the callbacks' "
                    "`on_before_optimizer_step` during `optimizer.step()`."
                )
        if config.decay is not None:
            config.decay.after_step()
        with guards.resetting():
            _reset(config, optimizers, engine)
        engine.advance(trainer.current_epoch)
        auto.window_closed(key, strategy, world)
        window = None
        if config.log or self.listeners:
            window = reporting.report(trainer.optimizers, engine, closing, key, schedulers=trainer.lr_scheduler_configs)
        if window is not None and config.log:  # (before the schedulers: a `ReduceLROnPlateau` may watch the loss)
            self.reported.publish(trainer, window, log_prefix)
        if schedulers is not None:  # (`step_schedulers=True`; plateau ones later, where Lightning steps them)
            raw = [o.optimizer for o in optimizers]
            schedulers.step(module, trainer, "step", engine.progress.step, raw, plateau=False)
            schedulers.defer_plateau(engine.progress.step, raw)
        if window is not None:
            reporting.announce(self.listeners, trainer, module, window)

    def before_optimizer_step(
        self, optimizer: Optimizer, config: AccumulationConfig, sharded: bool, clip: Callable[[Optimizer], None]
    ) -> None:
        """Inside the step of a window's optimizer, after AMP unscaling: normalise the window's gradient,
        add the decayed residual, ``clip``."""
        pending = self._pending.pop(id(optimizer), None)
        if pending is None:
            return
        scale, engine, done = pending
        params = [p for p in gradients.optimizer_params(optimizer) if id(p) not in done]
        done.update(id(p) for p in params)
        self.rescaled = True
        grads = gradients.grads_of(params)
        gradients.scale_(grads, scale)
        if engine.widened:  # (the narrow parameters' sums, normalised and rounded once, into `.grad` beside)
            engine.land(scale, params)
            grads = gradients.grads_of(params)
        if engine.closing is not None and engine.closing.norm_sq is None and not sharded:
            engine.metrics.add_grad_norm(grads)  # (made global after the counts: under DDP)
        if config.decay is not None:
            config.decay.combine(optimizer)
        if config.gradient_clip_val is not None:
            clip(optimizer)


def drop(engine: WindowEngine, params: Sequence[Tensor], config: AccumulationConfig) -> None:
    """Drop the group's open window unstepped (its loop stopped inside it): forget it and clear its gradient,
    zeroed (``reset="zero"``, the buffers kept) or ``None`` (a decay's residual waits aside, not in ``.grad``)."""
    engine.discard()
    if config.reset == "zero":
        gradients.zero_(gradients.grads_of(params))
    else:
        for p in params:
            p.grad = None


def _reset(config: AccumulationConfig, stepped: Sequence[Any], engine: WindowEngine) -> None:
    """Open the next window: zero the gradients (keeping the buffers) or set them to ``None``. Under
    ``grad_accum_dtype`` a narrow parameter's ``.grad`` is set to ``None`` either way: its window sum is kept in the
    wide buffer, and ``.grad`` is ``None`` between micro-batches."""
    wide = engine.wide if engine.widened else None
    for optimizer in stepped:
        if config.reset == "none":
            optimizer.zero_grad(set_to_none=True)
        elif config.reset == "zero":
            if wide is not None:
                for p in gradients.optimizer_params(optimizer.optimizer):
                    if wide.holds(p):
                        p.grad = None
            gradients.zero_(gradients.optimizer_grads(optimizer.optimizer))
