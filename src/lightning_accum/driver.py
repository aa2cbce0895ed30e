"""The mixin's driver: all it keeps on the module, and its part in Lightning's loop.

:class:`MixinDriver` is the one private object :class:`AccumulationMixin` puts on the user's
module. It holds the configuration and one :class:`~lightning_accum.engine.WindowEngine` per
window group, runs the backward passes under the sync plan, and at a window's end makes the
gradient global, steps the optimizers and their step-interval LR schedulers and resets the
gradients. As a callback (attached through ``configure_callbacks``) it rescales, decays and
clips inside Lightning's optimizer step, after AMP unscaling, and carries the state in
checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum import _seam, collectives, gradients, multitask, sync
from lightning_accum._lightning import Callback, log_window, loss_scale, pl
from lightning_accum.engine import WindowEngine
from lightning_accum.noise import check_noise_under
from lightning_accum.options import AccumulationConfig
from lightning_accum.schedules import as_schedule
from lightning_accum.window import Window, batch_size

GroupKey = tuple[int, ...]
Replay = list[tuple[Any, Callable[[Any], Tensor]]]


class MixinDriver(Callback):
    """State and window-end work of :class:`~lightning_accum.AccumulationMixin` (internal)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.config = AccumulationConfig(schedule=as_schedule(1))
        self.engines: dict[GroupKey, WindowEngine] = {}
        # with `backward_microbatches(size="auto")`: each window's (batch, loss_fn), to redo it after an OOM
        self.replay: dict[GroupKey, Replay] = {}
        self.auto_size: int | None = None  # samples per micro-batch found by `backward_microbatches`
        self.plan = sync.SyncPlan()
        self._pending: dict[int, float] = {}  # id(optimizer) -> the window's gradient scale, during its step
        self._saved_grads: list[Tensor | None] | None = None

    @property
    def state_key(self) -> str:
        return "AccumulationMixin"

    def configure(self, config: AccumulationConfig) -> None:
        self.config = config
        for engine in self.engines.values():
            engine.configure(config.schedule, config.normalize, config.lr_scaling)

    def engine(self, key: GroupKey) -> WindowEngine:
        engine = self.engines.get(key)
        if engine is None:
            c = self.config
            engine = self.engines[key] = WindowEngine(c.schedule, c.normalize, c.lr_scaling)
            engine.plan = self.plan
        return engine

    # ------------------------------------------------------------------ the module's optimizers
    def optimizers(self) -> list[Any]:
        optimizers = self.module.optimizers()
        return list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]

    def key(self, optimizer: Any) -> GroupKey:
        """The window group of ``optimizer``: ``None`` (all), an optimizer, its index, or a list of them."""
        optimizers = self.optimizers() if getattr(self.module, "_trainer", None) is not None else []
        if optimizer is None:
            return tuple(range(len(optimizers)))
        key = []
        for o in optimizer if isinstance(optimizer, list | tuple) else [optimizer]:
            if isinstance(o, int) and 0 <= o < len(optimizers):
                key.append(o)
                continue
            raw = getattr(o, "optimizer", o)
            matches = [i for i, lo in enumerate(optimizers) if lo is o or lo.optimizer is raw]
            if not matches:
                raise ValueError(f"`optimizer` must be one of `self.optimizers()` or its index; got {o!r}.")
            key.append(matches[0])
        return tuple(sorted(set(key)))

    def params(self, key: GroupKey | None = None) -> list[Tensor]:
        optimizers = self.optimizers()
        chosen = range(len(optimizers)) if key is None else key
        return [p for i in chosen for p in gradients.optimizer_params(optimizers[i].optimizer)]

    def window_open(self) -> bool:
        """Whether some window holds gradient that is not stepped yet."""
        return any(e.window is not None and e.window.microbatches for e in self.engines.values())

    # ------------------------------------------------------------------ checks and fit lifetime
    def check(self, trainer: Any) -> None:
        if self.module.automatic_optimization:
            raise RuntimeError(
                "`AccumulationMixin` drives manual optimization, but `automatic_optimization` is True: remove "
                "`self.automatic_optimization = True`, or use the `AccumulationScheduler` callback instead."
            )
        if self not in trainer.callbacks:
            raise RuntimeError(
                "The AccumulationMixin's callback is not attached: an override of `configure_callbacks` must "
                "include `super().configure_callbacks()` in what it returns."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)
        sync.refuse_deepspeed(trainer.strategy, "AccumulationMixin")
        self.plan = sync.plan(trainer.strategy, self.config.sync)
        for engine in self.engines.values():
            engine.plan = self.plan
        check_noise_under(self.plan, self.config.schedule)
        sync.refuse_fsdp_root_skip(self.plan, trainer.strategy.model)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved_grads is not None:
            gradients.restore(self.params(), self._saved_grads)
            self._saved_grads = None
        if self.config.decay is not None:
            self.config.decay.attach(trainer.optimizers)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.decay is not None:
            self.config.decay.detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, pl_module)

    # ------------------------------------------------------------------ backward passes
    def no_sync(self, final: bool) -> contextlib.AbstractContextManager[None]:
        """Context of one backward pass. DDP: always no-sync, the window is all-reduced explicitly
        at its end. FSDP, FSDP2: sync skipped before the window's last micro-batch if planned."""
        strategy = self.module.trainer.strategy
        if self.plan.family == "ddp":
            return sync.ddp_no_sync(strategy)
        return sync.skip_sync(self.plan, strategy, final)

    def backward(self, loss: Tensor, final: bool) -> None:
        with self.no_sync(final):
            self.module.manual_backward(loss)

    def trunk_backward(self, features: Tensor, grad: Tensor, final: bool) -> None:
        with self.no_sync(final):
            multitask._autograd_backward(features, grad)

    # ------------------------------------------------------------------ one window
    def begin(self, trainer: Any, key: GroupKey) -> tuple[Window, bool]:
        """The group's open window (opened now if none is), and whether this micro-batch is its last."""
        engine = self.engine(key)
        window = engine.window or engine.open(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx)
        last = window.microbatches + 1 >= window.k or _seam.epoch_ends_after_this_batch(trainer)
        return window, last

    def finish(
        self, trainer: Any, key: GroupKey, batch: Any, passes: int, items: int | Tensor | None, last: bool
    ) -> None:
        """Count a micro-batch that back-propagated (``passes`` > 0) and close the window at its last."""
        engine = self.engines[key]
        window = engine.window
        assert window is not None
        if passes:  # a micro-batch that back-propagated nothing does not count
            engine.count(batch_size(batch), self._items(items, batch))
            window.synced = last
            if engine.probe is not None and not last:
                engine.measure_first(gradients.grads_of(self.params(key)), loss_scale(trainer))
        if last:
            self.close(trainer, key)

    def _items(self, items: int | Tensor | None, batch: Any) -> int | Tensor:
        if items is not None:
            return items
        if self.config.count is not None:
            return self.config.count(batch)
        if self.config.normalize == "items":
            raise ValueError(
                "`normalize='items'` needs the micro-batch's item count: give `count=` to "
                "`configure_accumulation`, or call `acc.backward(loss, items=n)`."
            )
        return batch_size(batch)

    def close(self, trainer: Any, key: GroupKey) -> None:
        """Make the window's gradient global, step its optimizers and schedulers, reset, log."""
        config, engine, strategy = self.config, self.engines[key], trainer.strategy
        assert engine.window is not None
        world = collectives.world_size(strategy)
        if not engine.window.microbatches and world == 1:  # nothing went in: nothing to step
            engine.discard()
            return
        params = self.params(key)
        if world > 1 and self.plan.family == "ddp":
            closing = engine.close(strategy, [int(p.grad is not None) for p in params])
            collectives.all_reduce_gradients(strategy, params, closing.extra)
        else:  # single device, or FSDP's own (reduce-)scatter on the last micro-batch made the gradient global
            closing = engine.close(strategy)
        # the window's normalised gradient is `.grad * scale / loss scale`
        engine.measure_window(strategy, gradients.grads_of(params), closing.scale / loss_scale(trainer))
        stepped = [self.optimizers()[i] for i in key]
        for optimizer in stepped:
            self._pending[id(optimizer.optimizer)] = closing.scale
            engine.scale_lr(optimizer)
            try:
                optimizer.step()
            finally:
                engine.restore_lr()
            if self._pending.pop(id(optimizer.optimizer), None) is not None:
                raise RuntimeError(
                    "The window's gradient was not normalised: Lightning did not call the callbacks' "
                    "`on_before_optimizer_step` during `optimizer.step()`."
                )
        self._step_schedulers(trainer, [o.optimizer for o in stepped], engine.progress.step + 1)
        if config.decay is not None:
            config.decay.after_step()
        for optimizer in stepped:
            if config.reset == "none":
                optimizer.zero_grad(set_to_none=True)
            elif config.reset == "zero":
                gradients.zero_(gradients.optimizer_grads(optimizer.optimizer))
        engine.advance(trainer.current_epoch)
        if self.replay.pop(key, None) and world > 1:  # auto-sizing ran on every rank: all take the smallest
            unset = 2**62
            size = torch.tensor(self.auto_size or unset, device=strategy.root_device)
            agreed = int(strategy.reduce(size, reduce_op="min"))
            self.auto_size = None if agreed == unset else agreed
        if config.log:
            prefix = "accum/" if len(self.engines) == 1 else f"accum/opt{'_'.join(map(str, key))}/"
            every = trainer.log_every_n_steps
            log_window(self.module, prefix, every, closing, engine.progress, engine.noise_scale)

    def _step_schedulers(self, trainer: Any, optimizers: list[Optimizer], step: int) -> None:
        """Step the step-interval LR schedulers of these optimizers, every ``frequency`` steps."""
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            if getattr(scheduler, "optimizer", None) in optimizers and step % config.frequency == 0:
                self.module.lr_scheduler_step(scheduler, None)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        scale = self._pending.pop(id(optimizer), None)
        if scale is None:
            return
        gradients.scale_(gradients.optimizer_grads(optimizer), scale)
        config = self.config
        if config.decay is not None:
            config.decay.combine(optimizer)
        if config.gradient_clip_val is not None:
            pl_module.clip_gradients(
                optimizer,
                gradient_clip_val=config.gradient_clip_val,
                gradient_clip_algorithm=config.gradient_clip_algorithm,
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        groups = {",".join(map(str, key)): engine.state_dict() for key, engine in self.engines.items()}
        state: dict[str, Any] = {"groups": groups}
        if any(g["window"] is not None and g["window"]["microbatches"] for g in groups.values()):
            state["grads"] = gradients.snapshot(self.params())
        if self.config.decay is not None:
            state["decay"] = self.config.decay.state_dict()
        state["schedule"] = self.config.schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engines = {}
        for name, group in state_dict["groups"].items():
            self.engine(tuple(int(i) for i in name.split(",") if i)).load_state_dict(group)
        self._saved_grads = state_dict.get("grads")
        self.config.schedule.load_state_dict(state_dict.get("schedule", {}))
        if self.config.decay is not None and "decay" in state_dict:
            self.config.decay.load_state_dict(state_dict["decay"])
