"""The mixin's window-end step: the gradient made global, the group's optimizers and their
step-interval LR schedulers stepped, the gradients reset for the next window, the window logged.

``close`` runs when the ``accumulate`` block of a window's last micro-batch exits. The rescale,
decay and clipping happen inside ``optimizer.step()``, in the driver's
``on_before_optimizer_step`` (after AMP unscaling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_accum import collectives, gradients, schedulers
from lightning_accum._lightning import log_window, loss_scale
from lightning_accum.groups import GroupKey
from lightning_accum.options import AccumulationConfig

if TYPE_CHECKING:
    from lightning_accum.driver import MixinDriver


def close(driver: MixinDriver, trainer: Any, key: GroupKey) -> None:
    """Make the window's gradient global, step its optimizers and schedulers, reset, log."""
    config, engine, strategy = driver.config, driver.engines[key], trainer.strategy
    assert engine.window is not None
    world = collectives.world_size(strategy)
    if not engine.window.microbatches and world == 1:  # nothing went in: nothing to step
        engine.discard()
        return
    params = driver.params(key)
    if world > 1 and driver.plan.family == "ddp":
        closing = engine.close(strategy, [int(p.grad is not None) for p in params])
        collectives.all_reduce_gradients(strategy, params, closing.extra)
    else:  # single device, or FSDP's own (reduce-)scatter on the last micro-batch made the gradient global
        closing = engine.close(strategy)
    stepped = [driver.optimizers()[i] for i in key]
    driver.rescaled = False
    if closing.empty:  # nothing went in, over all ranks: no step (it would move Adam's state)
        _reset(config, stepped)
        engine.advance(trainer.current_epoch)
        return
    # the window's normalised gradient is `.grad * scale / loss scale`
    engine.measure_window(strategy, gradients.grads_of(params), closing.scale / loss_scale(trainer))
    rescaled: set[int] = set()
    for optimizer in stepped:
        driver.pending[id(optimizer.optimizer)] = closing.scale, engine, rescaled
        engine.scale_lr(optimizer)
        driver.guards.stepping = True
        try:
            optimizer.step()
        finally:
            driver.guards.stepping = False
            engine.restore_lr()
        if driver.pending.pop(id(optimizer.optimizer), None) is not None:
            raise RuntimeError(
                "The window's gradient was not normalised: Lightning did not call the callbacks' "
                "`on_before_optimizer_step` during `optimizer.step()`."
            )
    raw = [o.optimizer for o in stepped]
    schedulers.step_schedulers(driver.module, trainer, driver.monitors, "step", engine.progress.step + 1, raw)
    if config.decay is not None:
        config.decay.after_step()
    _reset(config, stepped)
    engine.advance(trainer.current_epoch)
    if driver.replay.pop(key, None) and world > 1:  # auto-sizing ran on every rank: all take the smallest
        unset = 2**62
        size = torch.tensor(driver.auto_size or unset, device=strategy.root_device)
        agreed = int(strategy.reduce(size, reduce_op="min"))
        driver.auto_size = None if agreed == unset else agreed
    if config.log:
        prefix = "accum/" if len(driver.engines) == 1 else f"accum/opt{'_'.join(map(str, key))}/"
        every = trainer.log_every_n_steps
        metrics = engine.window_metrics(closing)
        log_window(driver.module, prefix, every, closing, engine.progress, engine.noise_scale, metrics)


def _reset(config: AccumulationConfig, stepped: list[Any]) -> None:
    """Open the next window: zero the gradients (keeping the buffers) or set them to ``None``."""
    for optimizer in stepped:
        if config.reset == "none":
            optimizer.zero_grad(set_to_none=True)
        elif config.reset == "zero":
            gradients.zero_(gradients.optimizer_grads(optimizer.optimizer))
