"""``AccumulationMixin``: exact, scheduled accumulation for manual optimization.

The public façade. What it keeps lives in one private object on the module, the
``MixinDriver``, which owns the windows (one
``WindowEngine`` per optimizer group) and does the window-end
work; ``Accumulator`` runs the backward passes of the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_accum._core import microbatch
from lightning_accum._core.batchnorm import BatchNormMode
from lightning_accum._core.options import AccumulationConfig, Reduction, Reset
from lightning_accum._core.sync import SyncMode
from lightning_accum._core.window import Normalize
from lightning_accum._lightning import Callback, pl
from lightning_accum._trainer.accumulator import Accumulator
from lightning_accum._trainer.driver import MixinDriver
from lightning_accum.lr import LRMultiplier
from lightning_accum.schedules import Progress, Schedule, as_schedule

if TYPE_CHECKING:  # the mixin is only ever used in front of a LightningModule
    _ModuleBase = pl.LightningModule
else:
    _ModuleBase = object

__all__ = ["AccumulationMixin", "Accumulator"]


class AccumulationMixin(_ModuleBase):
    """Manual-optimization accumulation: ``class Model(AccumulationMixin, LightningModule)``.

    The mixin comes first in the bases (after the ``LightningModule`` it would never run: refused where the
    class is made). Sets ``automatic_optimization = False``. Configure once with ``configure_accumulation``
    (the same schedules as ``AccumulationScheduler``), then in
    ``training_step`` wrap the backward passes in ``accumulate``. The optimizers are stepped and
    the gradients reset by the mixin at each window's end; do not call ``optimizer.step()`` or
    ``zero_grad()`` yourself (both are refused during training, with the fix).

    LR schedulers are the model's to step, as in Lightning's manual optimization (e.g.
    ``self.lr_schedulers().step()`` in the model's ``on_window_end(self, window)``, for one step per
    optimizer step), unless
    ``configure_accumulation(step_schedulers=True)``: then the mixin steps them as Lightning's
    automatic loop would (and refuses a step of the model's own). A ``training_step`` that returns
    ``None`` without an ``accumulate`` block skips its batch. A model's ``on_window_end(self, window)``
    is called after each step, after the callbacks' (``WindowReport``). A loop stopped inside a window
    (``trainer.should_stop``) drops it, as Lightning's automatic loop does; a later fit without a
    checkpoint starts with no open window.

    If the model overrides ``configure_callbacks`` or ``on_validation_model_zero_grad``, it must
    call ``super()``.

    Example:

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

    @override
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, where the class is made, a class that puts ``AccumulationMixin`` after the ``LightningModule``
        in its bases: ``nn.Module.__init__`` does not call on, so the mixin's ``__init__`` and its hooks would
        never run (an ``AttributeError`` from inside the mixin at the first call otherwise)."""
        super().__init_subclass__(**kwargs)
        order = cls.__mro__
        if nn.Module in order and order.index(nn.Module) < order.index(AccumulationMixin):
            module = next(base for base in order[1:] if issubclass(base, nn.Module))
            mixins = [base for base in cls.__bases__ if issubclass(base, AccumulationMixin)]
            others = [base for base in cls.__bases__ if base not in mixins]
            given, fixed = (", ".join(base.__name__ for base in bases) for bases in (cls.__bases__, mixins + others))
            raise TypeError(
                f"`class {cls.__name__}({given})` puts `AccumulationMixin` after `{module.__name__}` in its bases, so "
                "the mixin's `__init__` and hooks would never run: the mixin must come before the LightningModule. "
                f"Put `AccumulationMixin` first: `class {cls.__name__}({fixed})`."
            )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self._accumulation = MixinDriver(self)  # all the mixin keeps on the module

    def configure_accumulation(
        self,
        schedule: Schedule | int | Mapping[int, int] = 1,
        *,
        normalize: Normalize = "mean",
        count: Callable[[Any], int | Tensor] | None = None,
        reduction: Reduction | None = None,
        reset: Reset = "zero",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        lr_scaling: Literal["linear", "sqrt", "adascale"] | None = None,
        lr_schedule: LRMultiplier | None = None,
        log: bool = True,
        sync: SyncMode = "auto",
        step_schedulers: bool | None = None,
        batchnorm: BatchNormMode = "micro-batch",
        grad_accum_dtype: torch.dtype | str | None = None,
        read_ahead: bool = False,
    ) -> None:
        """Set the schedule and the window-end policy.

        Args:
            schedule: a ``Schedule``, an ``int`` or an epoch-keyed ``dict``.
            normalize: ``"mean"`` (mean of the window's micro-batch gradients over ranks) or
                ``"items"`` (losses are sums over items; divide by the global item count).
            count: ``count(batch)`` items in a micro-batch (taken when its block opens); for ``"items"``
                either this or ``acc.backward(loss, items=n)`` on every pass.
            reduction: with ``"items"`` and ``count``: what ``acc.backward(loss)`` gets over the
                micro-batch's items, ``"sum"``, or ``"mean"`` (a Hugging Face ``outputs.loss``), then
                weighted by ``count(batch)``: the micro-batch's items, counted once however many passes it
                makes (``backward_each``, ``backward_heads``, ``backward_cached``; ``backward_microbatches``
                weighs each part by ``count(part)``). Required there, as on the callback; refused
                otherwise. A pass with ``items=n`` is a mean weighted by ``n`` under either.
            reset: after each step, ``"zero"`` the gradients (keep the buffers), set them to ``None``,
                or decay them with a ``GradientDecay``.
            gradient_clip_val: clip the normalised window gradient to this norm (or value).
            gradient_clip_algorithm: ``"norm"`` or ``"value"``.
            lr_scaling: ``"linear"`` or ``"sqrt"``: LR times ``k / k_first`` (or its root) for each step;
                ``"adascale"``: times AdaScale's gain from the measured gradient noise.
            lr_schedule: ``lr_schedule(progress) -> float``: a learning-rate multiplier for each
                step, keyed on the progress its window opened with (``lightning_accum.lr``).
            log: log ``accum/k``, ``accum/loss`` (the window's; ``accum/loss/<task>`` for tasks),
                ``accum/grad_norm``, ``accum/effective_batch``, ``accum/samples``, ``accum/items``; a
                window of some of several optimizers (``accumulate(batch, optimizer=i)``) under
                ``accum/opt<i>/`` instead (``accum/opt0/loss``).
            sync: gradient sync inside a window on sharded strategies: ``"auto"`` (FSDP2: once per
                window; FSDP: every micro-batch, as Lightning), ``"skip"`` (once per window; FSDP
                and FSDP2 then hold unsharded gradients until its end) or ``"every"``. DDP
                always syncs once per window.
            step_schedulers: who steps the LR schedulers of ``configure_optimizers``. ``None`` (default)
                or ``False``: the model, as Lightning's manual optimization says (``None`` warns at the
                fit's start that it does, where the fit has schedulers). ``True``: the mixin, as
                Lightning's automatic loop: ``interval="step"`` at each window's step (``frequency``
                in the window's optimizer steps, across epochs), ``"epoch"`` after each epoch,
                ``ReduceLROnPlateau`` with its config's ``monitor`` where Lightning's loop steps it (for
                ``"step"``, after the batch's ``on_train_batch_end`` and validation; for ``"epoch"``,
                after the model's ``on_train_epoch_end``); the configurations that loop refuses are
                refused at the fit's start, and a step the model takes itself is refused before any
                optimizer step uses it.
            batchnorm: ``"micro-batch"`` (BatchNorm's running statistics updated by every forward, as
                Lightning) or ``"window"`` (updated once per window with the pooled statistics of the
                micro-batches that went in, forwards inside ``accumulate`` blocks; one window of every optimizer).
                See "BatchNorm and accumulation".
            grad_accum_dtype: ``None`` (each window's gradient summed in ``.grad``, in the parameters' dtype) or
                ``torch.float32`` (also ``"float32"`` / ``"fp32"``): under bf16 or fp16 parameters each narrow
                parameter's window gradient is summed (every backward form), normalised and all-reduced in float32
                and rounded to its dtype once, for the step; between passes its ``.grad`` is ``None``. Single device
                and DDP; see "The window's precision".
            read_ahead: under a ``Budget`` on several ranks, read the counts of the next batches ahead from the
                training loader and sum them ``CHUNK`` (4) batches per all-reduce, a chunk before they are needed, as
                ``AccumulationScheduler`` does (``FabricAccumulator.read_ahead`` is the same in a Fabric loop): a rank
                then waits on no collective inside a window. Without it each block's count is summed in one
                all-reduce issued as the block opens and read at its end, where a rank waits for the slowest rank's
                arrival. Its contract: at most one ``accumulate`` block per ``training_step``, on that step's batch
                (a second block is refused); ``count`` is also called on each batch as the loader yields it (before
                ``on_before_batch_transfer``), and must give the same number as for the block's batch (refused
                otherwise, where both are host values). No effect without a ``Budget`` or on one process, beyond the
                contract. See "A budget on many ranks" in the guide's "A batch in tokens".

        Example:

            # a Hugging Face causal LM: `outputs.loss` is the mean over the batch's predicted tokens
            self.configure_accumulation(Ramp(1, 16, over=2_000_000, unit="items"), normalize="items",
                                        count=causal_lm_tokens, reduction="mean")
            ...
            with self.accumulate(batch) as acc:
                acc.backward(self.model(**batch).loss)  # weighted by causal_lm_tokens(batch)
        """
        self._accumulation.configure(
            AccumulationConfig(
                as_schedule(schedule),
                normalize,
                count,
                reset,
                gradient_clip_val,
                gradient_clip_algorithm,
                lr_scaling,
                log,
                sync,
                lr_schedule,
                step_schedulers,
                reduction,
                batchnorm,
                grad_accum_dtype,
                read_ahead,
            )
        )

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        callbacks = super().configure_callbacks()  # type: ignore[misc]
        callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        return [*callbacks, self._accumulation]

    @override
    def on_validation_model_zero_grad(self) -> None:
        """Lightning zeroes gradients before validation; keep them while a window is open."""
        if not self._accumulation.windows.window_open():
            with self._accumulation.guards.resetting():
                super().on_validation_model_zero_grad()  # type: ignore[misc]

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Refused during a training batch or while a window holds micro-batches: the mixin resets the gradients
        itself when a window closes (a ``zero_grad`` inside a window would throw its micro-batches away)."""
        self._accumulation.guards.check_zero_grad()
        super().zero_grad(set_to_none)

    # ------------------------------------------------------------------ windows
    def microbatches(self, batch: Any, size: int, *, split: microbatch.Split | None = None) -> list[Any]:
        """``batch`` split along dim 0 into micro-batches of ``size`` samples (the last may be
        shorter); tensors in dicts, lists, tuples and dataclasses. ``split(path, leaf) -> bool``: which
        leaves are cut (``True``) and which each micro-batch gets whole (``False``: a per-class weight);
        by default every tensor is cut. For automatic sizing on out-of-memory, use
        ``acc.backward_microbatches(loss_fn, size="auto")``."""
        return microbatch.split(batch, size, microbatch.check_split(split, "`microbatches`"))

    @property
    def accumulation_progress(self) -> Progress:
        """``Progress`` of the window group of all optimizers (or the only group)."""
        windows = self._accumulation.windows
        engine = windows.engines.get(windows.key(None))
        return Progress() if engine is None else engine.progress

    @contextlib.contextmanager
    def accumulate(self, batch: Any, optimizer: Any = None) -> Iterator[Accumulator]:
        """Open (or continue) the window and yield an ``Accumulator`` for this micro-batch.

        ``optimizer`` picks the window: ``None`` for one window shared by all optimizers, or an
        optimizer (or its index, or a list of them) for a window of its own. On exit at the
        window's last micro-batch the window is closed: gradients all-reduced (DDP), normalised,
        clipped, the optimizers stepped (with their step-interval schedulers under
        ``step_schedulers=True``), gradients reset.
        """
        trainer, driver = self.trainer, self._accumulation  # type: ignore[attr-defined]
        driver.check(trainer)
        block = driver.begin(trainer, optimizer, batch)
        acc = Accumulator(block, batch, driver.auto)
        finished = False
        try:
            yield acc
            finished = True
        finally:
            acc._close()
            driver.block_exited(block, finished)
        driver.finish(trainer, block)

    @override
    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Refused during training outside the accumulator: use ``acc.backward(loss)`` in the block."""
        self._accumulation.guards.check_manual_backward(self)
        super().manual_backward(loss, *args, **kwargs)  # type: ignore[misc]
