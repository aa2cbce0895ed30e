"""``AccumulationMixin``: exact, scheduled accumulation for manual optimization.

The mixin owns the windows (one per optimizer group), scales each backward pass, skips DDP's
sync inside the window, and at the window's end makes the gradient global, normalises it,
clips it, steps the optimizers and their step-interval LR schedulers, and resets the
gradients. A small callback it attaches through ``configure_callbacks`` does the work that
must happen inside Lightning's optimizer step (after AMP unscaling) and carries the state in
checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum import _seam, gradients, microbatch, multitask, sync
from lightning_accum._lightning import Callback, log_window, loss_scale, pl
from lightning_accum.callbacks.decay import GradientDecay
from lightning_accum.noise import NoiseProbe, NoiseScale, check_noise_under
from lightning_accum.schedules import Progress, Schedule, as_schedule
from lightning_accum.sync import SyncMode, check_sync_mode, partial_window_lost
from lightning_accum.window import NORMALIZE, Normalize, Window, batch_size, lr_factor

if TYPE_CHECKING:  # the mixin is only ever used in front of a LightningModule
    _ModuleBase = pl.LightningModule
else:
    _ModuleBase = object

Reset = Literal["zero", "none"] | GradientDecay
GroupKey = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    """What :meth:`AccumulationMixin.configure_accumulation` was given, validated."""

    schedule: Schedule
    normalize: str = "mean"
    count: Callable[[Any], int | Tensor] | None = None
    reset: Reset = "zero"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    lr_scaling: str | None = None
    log: bool = True
    sync: SyncMode = "auto"


@dataclasses.dataclass
class _Group:
    """Accumulation state of the optimizers that step together."""

    progress: Progress = dataclasses.field(default_factory=Progress)
    window: Window | None = None
    first_k: int | None = None
    # with `backward_microbatches(size="auto")`: the window's (batch, loss_fn), to redo it after an OOM
    replay: list[tuple[Any, Callable[[Any], Tensor]]] = dataclasses.field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {
            "progress": dataclasses.asdict(self.progress),
            "window": None if self.window is None else self.window.state_dict(),
            "first_k": self.first_k,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> _Group:
        window = state.get("window")
        return cls(
            progress=Progress(**state["progress"]),
            window=None if window is None else Window.from_state_dict(window),
            first_k=state.get("first_k"),
        )


class Accumulator:
    """What ``with self.accumulate(batch) as acc`` gives: backward passes into the open window.

    Attributes:
        k: micro-batches of the window.
        index: this micro-batch's position in the window (0-based).
        last: whether the window closes after this micro-batch (``k`` reached or epoch end).
    """

    def __init__(self, module: AccumulationMixin, group: _Group, key: GroupKey, batch: Any, last: bool) -> None:
        assert group.window is not None
        window = group.window
        self._module = module
        self._group, self._key, self._batch = group, key, batch
        self._window = window
        self.k = window.k
        self.index = window.microbatches
        self.last = last
        self.items: int | Tensor | None = None
        self.passes = 0
        self._open = True

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                "`acc.backward*` was called outside its `with self.accumulate(batch) as acc:` block; "
                "call it inside the block, which closes the window on exit."
            )

    def _backward(self, loss: Tensor) -> None:
        """``manual_backward(loss / divisor)`` with gradient sync skipped as the plan says."""
        module = self._module
        with module._accum_no_sync(self.last):
            module.manual_backward(loss / self._window.divisor)
        self.passes += 1

    def _add_items(self, items: int | Tensor | None) -> None:
        if items is not None:
            self.items = items if self.items is None else self.items + items

    def backward(self, loss: Tensor, *, items: int | Tensor | None = None) -> None:
        """Back-propagate one loss into the window.

        With ``normalize="items"``, ``loss`` is a sum over the micro-batch's items; or pass a mean
        loss with ``items=n`` and it is weighted by ``n``.
        """
        self._check_open()
        loss = multitask.check_loss(loss, "the loss passed to `acc.backward`")
        self._backward(loss if items is None else loss * items)
        self._add_items(items)

    def backward_each(
        self,
        closures: Sequence[Callable[[], Tensor]],
        weights: Sequence[float] | None = None,
        *,
        grad_norms: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run each closure's forward and backward in turn: one task graph alive at a time.

        Returns the detached per-task losses, and with ``grad_norms=True`` also the L2 norm of
        each task's weighted gradient (one gradient copy per task).
        """
        self._check_open()
        params = self._module._accum_params() if grad_norms else None
        losses, norms = multitask.backward_each(self._backward, closures, weights, grad_norms_of=params)
        return (losses, norms) if grad_norms else losses  # type: ignore[return-value]

    def backward_microbatches(self, loss_fn: Callable[[Any], Tensor], size: int | Literal["auto"] = "auto") -> Tensor:
        """Split this micro-batch's ``batch`` along dim 0 and back-propagate ``loss_fn(part)`` for
        each part, weighted so that the result equals the whole batch's (sample-weighted for
        ``"mean"``, plain sums for ``"items"``). Returns the detached per-part losses.

        ``size="auto"`` starts with the whole batch and, on CUDA out-of-memory, frees the
        window's gradient, halves the size, and redoes the window from its first micro-batch
        (its batches are kept by reference): no sample is lost or counted twice. The size is kept
        for later batches and agreed on by all ranks (their minimum) at each window's end.
        """
        self._check_open()
        module = self._module
        if size != "auto":
            return self._run_parts(self._batch, loss_fn, size)
        redo: list[tuple[Any, Callable[[Any], Tensor]]] = []
        while True:
            size = module._accum_auto_size or microbatch.batch_length(self._batch)
            try:
                for past_batch, past_fn in redo:
                    self._run_parts(past_batch, past_fn, size)
                losses = self._run_parts(self._batch, loss_fn, size)
                break
            except Exception as error:
                if not microbatch.is_oom(error):
                    raise
                if size == 1:
                    raise RuntimeError(
                        "Out of memory with micro-batches of a single sample: one sample does not fit. Reduce the "
                        "model or sequence size, or use a strategy that shards it (FSDP)."
                    ) from error
            # outside the `except` block, so that the error's frames (and their tensors) are freed
            for p in module._accum_params(self._key):
                p.grad = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            module._accum_auto_size = max(1, size // 2)
            redo = list(self._group.replay)
        self._group.replay.append((self._batch, loss_fn))
        return losses

    def _run_parts(self, batch: Any, loss_fn: Callable[[Any], Tensor], size: int) -> Tensor:
        n = microbatch.batch_length(batch)
        mean = self._module._accum_config.normalize == "mean"
        losses = []
        for part in microbatch.split(batch, size):
            loss = multitask.check_loss(loss_fn(part), "the loss returned by `loss_fn`")
            self._backward(loss * (microbatch.batch_length(part) / n) if mean and size < n else loss)
            losses.append(loss.detach())
        return torch.stack(losses)

    def backward_heads(
        self,
        features: Tensor,
        heads: Sequence[Callable[[Tensor], Tensor]],
        weights: Sequence[float] | None = None,
    ) -> Tensor:
        """Shared trunk: each head back-propagates into a detached copy of ``features`` in turn,
        then the trunk back-propagates once with the summed feature gradient. Peak memory is the
        trunk's graph plus the largest head's. Returns the detached per-head losses."""
        self._check_open()

        def trunk_backward(features: Tensor, grad: Tensor) -> None:
            with self._module._accum_no_sync(self.last):
                multitask._autograd_backward(features, grad)
            self.passes += 1

        return multitask.backward_heads(self._backward, features, heads, weights, trunk_backward=trunk_backward)


class AccumulationMixin(_ModuleBase):
    """Manual-optimization accumulation: ``class Model(AccumulationMixin, LightningModule)``.

    Sets ``automatic_optimization = False``. Configure once with :meth:`configure_accumulation`
    (the same schedules as :class:`~lightning_accum.AccumulationScheduler`), then in
    ``training_step`` wrap the backward passes in :meth:`accumulate`. The optimizers are stepped,
    their step-interval LR schedulers stepped and the gradients reset by the mixin at each
    window's end; do not call ``optimizer.step()`` or ``zero_grad()`` yourself.

    If the model overrides ``configure_callbacks`` or ``on_validation_model_zero_grad``, it must
    call ``super()``.

    Example::

        class Model(AccumulationMixin, pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)
                self.configure_accumulation(Ramp(1, 8, over=10_000), gradient_clip_val=1.0)

            def training_step(self, batch, batch_idx):
                x, y = batch
                with self.accumulate(batch) as acc:
                    acc.backward(torch.nn.functional.mse_loss(self.net(x), y))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self._accum_config = AccumulationConfig(schedule=as_schedule(1))
        self._accum_groups: dict[GroupKey, _Group] = {}
        self._accum_driver = _MixinDriver(self)
        self._accum_auto_size: int | None = None  # samples per micro-batch found by `backward_microbatches`

    def configure_accumulation(
        self,
        schedule: Schedule | int | Mapping[int, int] = 1,
        *,
        normalize: Normalize = "mean",
        count: Callable[[Any], int | Tensor] | None = None,
        reset: Reset = "zero",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        lr_scaling: Literal["linear", "sqrt"] | None = None,
        log: bool = True,
        sync: SyncMode = "auto",
    ) -> None:
        """Set the schedule and the window-end policy.

        Args:
            schedule: a :class:`~lightning_accum.Schedule`, an ``int`` or an epoch-keyed ``dict``.
            normalize: ``"mean"`` (mean of the window's micro-batch gradients over ranks) or
                ``"items"`` (losses are sums over items; divide by the global item count).
            count: ``count(batch)`` items in a micro-batch; for ``"items"`` either this or
                ``acc.backward(loss, items=n)``.
            reset: after each step, ``"zero"`` the gradients (keep the buffers), set them to ``None``,
                or decay them with a :class:`~lightning_accum.GradientDecay`.
            gradient_clip_val: clip the normalised window gradient to this norm (or value).
            gradient_clip_algorithm: ``"norm"`` or ``"value"``.
            lr_scaling: ``"linear"`` or ``"sqrt"``: LR times ``k / k_first`` (or its root) for each step.
            log: log ``accum/k``, ``accum/effective_batch``, ``accum/samples``, ``accum/items``.
            sync: gradient sync inside a window on sharded strategies: ``"auto"`` (FSDP2: once per
                window; FSDP: every micro-batch, as Lightning), ``"skip"`` (once per window; FSDP
                and FSDP2 then hold unsharded gradients until its end) or ``"every"``. DDP
                always syncs once per window.
        """
        if normalize not in NORMALIZE:
            raise ValueError(f"`normalize` must be 'mean' or 'items'; got {normalize!r}.")
        if count is not None and not callable(count):
            raise TypeError(f"`count` must be a function count(batch) -> int; got {count!r}.")
        if not (isinstance(reset, GradientDecay) or reset in ("zero", "none")):
            raise ValueError(f"`reset` must be 'zero', 'none' or a `GradientDecay`; got {reset!r}.")
        if gradient_clip_val is not None and (not isinstance(gradient_clip_val, int | float) or gradient_clip_val <= 0):
            raise ValueError(f"`gradient_clip_val` must be a number > 0 or None; got {gradient_clip_val!r}.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"`gradient_clip_algorithm` must be 'norm' or 'value'; got {gradient_clip_algorithm!r}.")
        if lr_scaling not in (None, "linear", "sqrt"):
            raise ValueError(f"`lr_scaling` must be None, 'linear' or 'sqrt'; got {lr_scaling!r}.")
        check_sync_mode(sync)
        schedule = as_schedule(schedule)
        if schedule.unit == "items" and count is None:
            raise ValueError(f"The schedule {schedule!r} counts items, so `count` is needed (count(batch) -> int).")
        self._accum_config = AccumulationConfig(
            schedule, normalize, count, reset, gradient_clip_val, gradient_clip_algorithm, lr_scaling, log, sync
        )

    # ------------------------------------------------------------------ Lightning hooks
    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        callbacks = super().configure_callbacks()  # type: ignore[misc]
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        return [*callbacks, self._accum_driver]

    def on_validation_model_zero_grad(self) -> None:
        """Lightning zeroes gradients before validation; keep them while a window is open."""
        if not any(g.window is not None and g.window.microbatches for g in self._accum_groups.values()):
            super().on_validation_model_zero_grad()  # type: ignore[misc]

    # ------------------------------------------------------------------ windows
    def microbatches(self, batch: Any, size: int) -> list[Any]:
        """``batch`` split along dim 0 into micro-batches of ``size`` samples (the last may be
        shorter); tensors in dicts, lists, tuples and dataclasses. For automatic sizing on
        out-of-memory, use ``acc.backward_microbatches(loss_fn, size="auto")``."""
        return microbatch.split(batch, size)

    @property
    def accumulation_progress(self) -> Progress:
        """:class:`Progress` of the window group of all optimizers (or the only group)."""
        group = self._accum_groups.get(self._accum_key(None))
        return Progress() if group is None else group.progress

    @contextlib.contextmanager
    def accumulate(self, batch: Any, optimizer: Any = None) -> Iterator[Accumulator]:
        """Open (or continue) the window and yield an :class:`Accumulator` for this micro-batch.

        ``optimizer`` picks the window: ``None`` for one window shared by all optimizers, or an
        optimizer (or its index, or a list of them) for a window of its own. On exit at the
        window's last micro-batch the window is closed: gradients all-reduced (DDP), normalised,
        clipped, the optimizers stepped with their step-interval schedulers, gradients reset.
        """
        trainer = self.trainer  # type: ignore[attr-defined]
        self._accum_check(trainer)
        key = self._accum_key(optimizer)
        group = self._accum_groups.setdefault(key, _Group())
        if group.window is None:
            self._accum_open(trainer, group)
        assert group.window is not None
        window = group.window
        last = window.microbatches + 1 >= window.k or _seam.epoch_ends_after_this_batch(trainer)
        acc = Accumulator(self, group, key, batch, last)
        try:
            yield acc
        finally:
            acc._open = False
        if acc.passes:  # a micro-batch that back-propagated nothing does not count
            window.add(batch_size(batch), self._accum_items(acc, batch))
            window.synced = last
        probe = self._accum_driver.probe
        if probe is not None and acc.passes and acc.index == 0 and not last:
            probe.first_microbatch(gradients.grads_of(self._accum_params(key)), window, loss_scale(trainer))
        if last:
            self._accum_close(trainer, key, group)

    def _accum_no_sync(self, final: bool) -> contextlib.AbstractContextManager[None]:
        """Context of one backward pass. DDP: always no-sync, the window is all-reduced explicitly
        at its end. FSDP, FSDP2: sync skipped before the window's last micro-batch if planned."""
        plan, strategy = self._accum_driver.sync_plan, self.trainer.strategy  # type: ignore[attr-defined]
        if plan.family == "ddp":
            return sync.ddp_no_sync(strategy)
        return sync.skip_sync(plan, strategy, final)

    def _accum_check(self, trainer: Any) -> None:
        if self.automatic_optimization:
            raise RuntimeError(
                "`AccumulationMixin` drives manual optimization, but `automatic_optimization` is True: remove "
                "`self.automatic_optimization = True`, or use the `AccumulationScheduler` callback instead."
            )
        if self._accum_driver not in trainer.callbacks:
            raise RuntimeError(
                "The AccumulationMixin's callback is not attached: an override of `configure_callbacks` must "
                "include `super().configure_callbacks()` in what it returns."
            )

    def _accum_optimizers(self) -> list[Any]:
        optimizers = self.optimizers()  # type: ignore[attr-defined]
        return list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]

    def _accum_key(self, optimizer: Any) -> GroupKey:
        optimizers = self._accum_optimizers() if self._trainer_attached() else []
        if optimizer is None:
            return tuple(range(len(optimizers)))
        wanted = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        key = []
        for o in wanted:
            if isinstance(o, int) and 0 <= o < len(optimizers):
                key.append(o)
                continue
            raw = getattr(o, "optimizer", o)
            matches = [i for i, lo in enumerate(optimizers) if lo is o or lo.optimizer is raw]
            if not matches:
                raise ValueError(f"`optimizer` must be one of `self.optimizers()` or its index; got {o!r}.")
            key.append(matches[0])
        return tuple(sorted(set(key)))

    def _trainer_attached(self) -> bool:
        return getattr(self, "_trainer", None) is not None

    def _accum_params(self, key: GroupKey | None = None) -> list[Tensor]:
        optimizers = self._accum_optimizers()
        chosen = range(len(optimizers)) if key is None else key
        return [p for i in chosen for p in gradients.optimizer_params(optimizers[i].optimizer)]

    def _accum_open(self, trainer: Any, group: _Group) -> None:
        epoch = trainer.current_epoch
        if group.progress.epoch != epoch:
            group.progress = dataclasses.replace(group.progress, epoch=epoch)
        k = self._accum_config.schedule(group.progress)
        if group.first_k is None:
            group.first_k = k
        group.window = Window(k=k, start=trainer.fit_loop.epoch_loop.batch_idx, divisor=k)

    def _accum_items(self, acc: Accumulator, batch: Any) -> int | Tensor:
        config = self._accum_config
        if acc.items is not None:
            return acc.items
        if config.count is not None:
            return config.count(batch)
        if config.normalize == "items":
            raise ValueError(
                "`normalize='items'` needs the micro-batch's item count: give `count=` to "
                "`configure_accumulation`, or call `acc.backward(loss, items=n)`."
            )
        return batch_size(batch)

    def _accum_close(self, trainer: Any, key: GroupKey, group: _Group) -> None:
        config, window, strategy = self._accum_config, group.window, trainer.strategy
        assert window is not None
        if not window.microbatches and sync.world_size(strategy) == 1:  # nothing went in: nothing to step
            group.window = None
            return
        sync.check_window_synced(self._accum_driver.sync_plan, window)
        params = self._accum_params(key)
        local = [window.microbatches, window.samples, window.local_items()]
        world = sync.world_size(strategy)
        if world > 1 and self._accum_driver.sync_plan.family == "ddp":
            counts = sync.sum_over_ranks(strategy, local + [int(p.grad is not None) for p in params])
            sync.all_reduce_gradients(strategy, params, counts[3:])
        else:  # single device, or FSDP's own (reduce-)scatter on the last micro-batch made the gradient global
            counts = sync.sum_over_ranks(strategy, local)
        scale = window.gradient_scale(
            config.normalize, world_size=world, global_microbatches=counts[0], global_items=counts[2]
        )
        probe = self._accum_driver.probe
        if probe is not None:  # the window's normalised gradient is `.grad * scale / loss scale`
            probe.window_end(strategy, gradients.grads_of(params), counts, scale / loss_scale(trainer))
        optimizers = self._accum_optimizers()
        stepped = [optimizers[i] for i in key]
        lr_scale = lr_factor(config.lr_scaling, window.k, group.first_k)
        for optimizer in stepped:
            self._accum_driver.pending[id(optimizer.optimizer)] = scale
            saved = [g["lr"] for g in optimizer.param_groups]
            if lr_scale != 1.0:
                for g in optimizer.param_groups:
                    g["lr"] = g["lr"] * lr_scale
            try:
                optimizer.step()
            finally:
                for g, lr in zip(optimizer.param_groups, saved, strict=True):
                    g["lr"] = lr
            if self._accum_driver.pending.pop(id(optimizer.optimizer), None) is not None:
                raise RuntimeError(
                    "The window's gradient was not normalised: Lightning did not call the callbacks' "
                    "`on_before_optimizer_step` during `optimizer.step()`."
                )
        step = group.progress.step + 1
        self._accum_step_schedulers(trainer, [o.optimizer for o in stepped], step)
        if isinstance(config.reset, GradientDecay):
            config.reset.after_step()
        for optimizer in stepped:
            if config.reset == "none":
                optimizer.zero_grad(set_to_none=True)
            elif config.reset == "zero":
                gradients.zero_(gradients.optimizer_grads(optimizer.optimizer))
        group.progress = Progress(
            epoch=trainer.current_epoch,
            step=step,
            samples=group.progress.samples + counts[1],
            items=group.progress.items + counts[2],
            microbatches=group.progress.microbatches + window.microbatches,
        )
        group.window = None
        if group.replay and world > 1:  # auto-sizing ran on every rank: all take the smallest size found
            unset = 2**62
            size = torch.tensor(self._accum_auto_size or unset, device=strategy.root_device)
            agreed = int(strategy.reduce(size, reduce_op="min"))
            self._accum_auto_size = None if agreed == unset else agreed
        group.replay.clear()
        if config.log:
            prefix = "accum/" if len(self._accum_groups) == 1 else f"accum/opt{'_'.join(map(str, key))}/"
            noise = None if probe is None else probe.schedule.noise_scale
            log_window(self, step, trainer.log_every_n_steps, prefix, window.k, counts[1], group.progress, noise)

    def _accum_step_schedulers(self, trainer: Any, optimizers: list[Optimizer], step: int) -> None:
        """Step the step-interval LR schedulers of these optimizers, every ``frequency`` steps."""
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            if getattr(scheduler, "optimizer", None) in optimizers and step % config.frequency == 0:
                self.lr_scheduler_step(scheduler, None)  # type: ignore[attr-defined]


class _MixinDriver(Callback):
    """The mixin's part inside Lightning's loop: validation at fit start, the rescale and
    clipping inside ``optimizer.step()`` (after AMP unscaling), and checkpoint state."""

    def __init__(self, module: AccumulationMixin) -> None:
        self.module = module
        self.pending: dict[int, float] = {}
        self.sync_plan = sync.SyncPlan()
        self._saved_grads: list[Tensor | None] | None = None
        self._probe: NoiseProbe | None = None

    @property
    def state_key(self) -> str:
        return "AccumulationMixin"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.module._accum_check(trainer)
        sync.refuse_deepspeed(trainer.strategy, "AccumulationMixin")
        config = self.module._accum_config
        self.sync_plan = sync.plan(trainer.strategy, config.sync)
        check_noise_under(self.sync_plan, config.schedule)
        model = trainer.strategy.model
        if (
            self.sync_plan.family == "fsdp"
            and self.sync_plan.skip
            and model is not None
            and sync.fsdp_roots(model) == [model]
        ):
            raise ValueError(
                "`sync='skip'` cannot work with the mixin when `FSDPStrategy` wraps the whole LightningModule: "
                "Lightning runs `training_step` inside FSDP's forward, where FSDP refuses `no_sync()`. Use "
                "`sync='auto'` (reduce-scatter every micro-batch), wrap submodules in `configure_model`, or use "
                "FSDP2 (`ModelParallelStrategy`)."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved_grads is not None:
            gradients.restore(self.module._accum_params(), self._saved_grads)
            self._saved_grads = None
        if self.decay is not None:
            self.decay.attach(trainer.optimizers)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.decay is not None:
            self.decay.detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, pl_module)

    @property
    def probe(self) -> NoiseProbe | None:
        config = self.module._accum_config
        if not isinstance(config.schedule, NoiseScale):
            return None
        if (
            self._probe is None
            or self._probe.schedule is not config.schedule
            or self._probe.normalize != config.normalize
        ):
            self._probe = NoiseProbe(config.schedule, config.normalize)
        return self._probe

    @property
    def decay(self) -> GradientDecay | None:
        reset = self.module._accum_config.reset
        return reset if isinstance(reset, GradientDecay) else None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        scale = self.pending.pop(id(optimizer), None)
        if scale is None:
            return
        gradients.scale_(gradients.optimizer_grads(optimizer), scale)
        if self.decay is not None:
            self.decay.combine(optimizer)
        config = self.module._accum_config
        if config.gradient_clip_val is not None:
            pl_module.clip_gradients(
                optimizer,
                gradient_clip_val=config.gradient_clip_val,
                gradient_clip_algorithm=config.gradient_clip_algorithm,
            )

    def state_dict(self) -> dict[str, Any]:
        groups = self.module._accum_groups
        if any(partial_window_lost(self.sync_plan, g.window) for g in groups.values()):
            groups = {key: dataclasses.replace(g, window=None) for key, g in groups.items()}
        state: dict[str, Any] = {"groups": {",".join(map(str, key)): g.state_dict() for key, g in groups.items()}}
        if any(g.window is not None and g.window.microbatches for g in groups.values()):
            state["grads"] = gradients.snapshot(self.module._accum_params())
        if self.decay is not None:
            state["decay"] = self.decay.state_dict()
        state["schedule"] = self.module._accum_config.schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module._accum_groups = {
            tuple(int(i) for i in key.split(",") if i): _Group.from_state_dict(g)
            for key, g in state_dict["groups"].items()
        }
        self._saved_grads = state_dict.get("grads")
        self.module._accum_config.schedule.load_state_dict(state_dict.get("schedule", {}))
        if self.decay is not None and "decay" in state_dict:
            self.decay.load_state_dict(state_dict["decay"])
