"""``FabricAccumulator``: the window engine in a Lightning Fabric loop.

A hand-written Fabric loop accumulates with ``fabric.no_backward_sync`` and ``fabric.backward(loss /
k)`` and steps at every k-th iteration: a fixed k, the mean of per-micro-batch means, no state to
resume a window from. This adapter gives such a loop what the Trainer's adapters give: windows
whose k follows a schedule, normalised by what really went in (token-weighted over micro-batches
and ranks), LR scaling and schedules keyed on progress, clipping of the normalised gradient, window
reports, and a ``state_dict`` that resumes at a step or inside a window. Under DDP every
micro-batch's backward skips the gradient sync and the window's gradient is all-reduced once, at
its end (with the counts' all-reduce before it), also when ``flush`` closes a short window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from lightning_accum import gradients
from lightning_accum.checkpoint import PartialWindow
from lightning_accum.engine import WindowEngine
from lightning_accum.lr import LRMultiplier
from lightning_accum.metrics import weigh
from lightning_accum.options import Count, LRScaling, Reduction, check_callback_items, check_common
from lightning_accum.reporting import WindowReport, metric_values, report
from lightning_accum.samples import sample_count
from lightning_accum.schedules import Progress, Schedule
from lightning_accum.window import Normalize


class _Ranks:
    """What the package's collectives ask of a strategy, from a Fabric (whose strategies reduce with
    ``all_reduce``)."""

    def __init__(self, fabric: Any) -> None:
        self._fabric = fabric

    @property
    def world_size(self) -> int:
        return int(self._fabric.world_size)

    @property
    def global_rank(self) -> int:
        return int(self._fabric.global_rank)

    @property
    def root_device(self) -> Any:
        return self._fabric.device

    def reduce(self, tensor: Tensor, reduce_op: str = "sum") -> Tensor:
        return self._fabric.all_reduce(tensor, reduce_op=reduce_op)  # type: ignore[no-any-return]

    def all_gather(self, tensor: Tensor) -> Tensor:
        return self._fabric.all_gather(tensor)  # type: ignore[no-any-return]


class FabricStep:
    """One micro-batch of a ``FabricAccumulator`` window (what ``accumulate`` yields).

    Attributes:
        stepped: after the block, whether the window closed with an optimizer step.
        window: after the block, the stepped window's ``WindowReport`` (``None`` otherwise).
    """

    def __init__(self, accumulator: FabricAccumulator, batch: Any) -> None:
        self._acc = accumulator
        self._batch = batch
        self.passes = 0
        self.items: int | Tensor | None = None
        self.stepped = False
        self.window: WindowReport | None = None

    def backward(self, loss: Tensor, *, items: int | Tensor | None = None) -> None:
        """``fabric.backward`` of ``loss`` with the window's weight: divided by the window's ``k``, and
        a mean over the micro-batch's items (``reduction="mean"``, or ``items=``) weighted by their count."""
        self.passes += 1
        self._acc._backward(self, loss, items)


class FabricAccumulator:
    """Exact, scheduled gradient accumulation in a Lightning Fabric loop.

    Args:
        fabric: the ``Fabric``; ``model`` and ``optimizer`` are what ``fabric.setup`` returned.
        model: the Fabric-wrapped module (its gradient sync is skipped inside a window).
        optimizer: the Fabric-wrapped optimizer the windows step.
        schedule: a ``Schedule`` or an ``int`` (epoch-keyed schedules need ``epoch=`` in ``accumulate``).
        normalize: ``"mean"`` (the mean of the micro-batches' gradients over all ranks) or ``"items"``
            (the summed per-item gradient over the window's global item count).
        count: ``count(batch) -> int | Tensor``: a micro-batch's items; required for ``"items"``.
        reduction: what the loss is over a micro-batch's items with ``"items"``: ``"sum"``, or
            ``"mean"`` (weighted by the count); required with ``"items"``.
        lr_scaling: ``None``, ``"linear"``, ``"sqrt"`` or ``"adascale"``.
        lr_schedule: a learning-rate multiplier keyed on ``Progress`` (``lightning_accum.lr``).
        gradient_clip_val: clip the normalised window gradient (``fabric.clip_gradients``).
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        log: report each window (``accum/*`` through ``fabric.log_dict``, and ``step.window``).

    Example:

        acc = FabricAccumulator(fabric, model, optimizer, Ramp(1, 16, over=2_000_000, unit="items"),
                                normalize="items", count=causal_lm_tokens, reduction="mean")
        for batch in loader:
            with acc.accumulate(batch) as step:
                step.backward(model(**batch).loss)
        acc.flush()  # the data ran out: a short last window, divided by its own size
        fabric.save(path, {"model": model, "optimizer": optimizer, "accumulation": acc})
    """

    def __init__(
        self,
        fabric: Any,
        model: Any,
        optimizer: Any,
        schedule: Schedule | int = 1,
        *,
        normalize: Normalize = "mean",
        count: Count | None = None,
        reduction: Reduction | None = None,
        lr_scaling: LRScaling | None = None,
        lr_schedule: LRMultiplier | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        log: bool = True,
    ) -> None:
        from lightning.fabric.wrappers import is_wrapped

        self.schedule = check_common("FabricAccumulator", schedule, normalize, count, lr_scaling, "auto", lr_schedule)
        self.reduction = check_callback_items(normalize, count, reduction)
        for name, wrapped in (("model", model), ("optimizer", optimizer)):
            if not is_wrapped(wrapped):
                raise TypeError(
                    f"`{name}` must be the one `fabric.setup(...)` returned (got a plain {type(wrapped).__name__}): "
                    "the accumulator skips its gradient sync and steps it through Fabric."
                )
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"`gradient_clip_algorithm` must be 'norm' or 'value'; got {gradient_clip_algorithm!r}.")
        self.fabric, self.model, self.optimizer = fabric, model, optimizer
        self.normalize, self.count = normalize, count
        self.clip_val, self.clip_algorithm, self.log = gradient_clip_val, gradient_clip_algorithm, log
        self._engine = WindowEngine(self.schedule, normalize, lr_scaling, lr_schedule)
        self._engine.metrics.tracking = log
        self._ranks = _Ranks(fabric)
        self._partial = PartialWindow()
        self._resumed = False  # a checkpoint's numbers wait to be put back (at the next block)
        self._epoch = 0
        self._batch = 0  # micro-batches of the epoch so far

    @property
    def progress(self) -> Progress:
        """How far training has come: optimizer steps, samples and items over all ranks, epoch."""
        return self._engine.progress

    @property
    def params(self) -> list[Tensor]:
        """The parameters the windows step (the optimizer's)."""
        return gradients.optimizer_params(self.optimizer.optimizer)

    # ------------------------------------------------------------------ one micro-batch
    @contextlib.contextmanager
    def accumulate(self, batch: Any, *, epoch: int | None = None) -> Iterator[FabricStep]:
        """One micro-batch: ``step.backward(loss)`` inside; the window steps when the block of its
        last micro-batch exits. ``epoch``: the epoch the batch belongs to (needed by epoch-keyed
        schedules; call ``flush()`` at each epoch's end)."""
        self._check_epoch(epoch)
        engine = self._engine
        self._put_back()
        if engine.window is None:
            engine.open(self._epoch, self._batch, self._ranks)
        step = FabricStep(self, batch)
        with self.fabric.no_backward_sync(self.model, enabled=self._ranks.world_size > 1):
            yield step
        if not step.passes:
            raise RuntimeError(
                "The `accumulate` block made no `step.backward(loss)`: call it (not `fabric.backward`) for the "
                "micro-batch's loss, so that it is weighted into the window."
            )
        samples = sample_count(batch, engine.samples_needed_by)
        items = step.items if step.items is not None else (samples if self.count is None else self.count(batch))
        engine.count(samples, items)
        engine.backward_done()
        engine.batch_done()
        self._batch += 1
        window = engine.window
        assert window is not None
        if window.microbatches >= window.k:
            self._step(step)
        elif engine.wants_prefix():  # the noise probe's prefix (`NoiseScale`, AdaScale): this rank's gradient
            scaler = getattr(self.fabric.strategy.precision, "scaler", None)
            engine.measure_prefix(gradients.grads_of(self.params), _scale(scaler))

    def _put_back(self) -> None:
        """After ``load_state_dict``, before the window goes on (a block, or ``flush``): this rank's
        part of a window the checkpoint held, and its partial gradient."""
        if self._resumed:
            numbers = self._partial.numbers(self._ranks, self._ranks.global_rank)
            if numbers is not None:
                self._engine.load_local_numbers(numbers)
            self._partial.put_back(self.params)
            self._resumed = False

    def _check_epoch(self, epoch: int | None) -> None:
        if epoch is None:
            if self.schedule.unit == "epoch":
                raise ValueError(
                    f"The schedule {self.schedule!r} is keyed on epochs: give `acc.accumulate(batch, epoch=e)` and "
                    "call `acc.flush()` at each epoch's end."
                )
            return
        if epoch != self._epoch:
            if self._engine.window is not None and self._engine.window.microbatches:
                raise RuntimeError(
                    f"Epoch {epoch} began inside a window of epoch {self._epoch}: call `acc.flush()` at each epoch's "
                    "end (a window does not cross epochs)."
                )
            self._epoch, self._batch = epoch, 0

    def _backward(self, step: FabricStep, loss: Tensor, items: int | Tensor | None) -> None:
        window = self._engine.window
        assert window is not None
        if items is None and self.reduction == "mean":
            items = self.count(step._batch) if self.count is not None else None
        nothing: bool | Tensor = False  # (a mean over no items, NaN, adds nothing)
        if items is not None:
            step.items = items if step.items is None else step.items + items  # type: ignore[operator]
            nothing = gradients.no_items(items)
            loss = weigh(loss, items)
        self._engine.metrics.add_loss(loss)
        handles = [] if nothing is False else gradients.add_nothing_if(self.params, nothing)
        try:
            self.fabric.backward(loss / window.divisor, model=self.model)
        finally:
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------ the window's end
    def flush(self) -> WindowReport | None:
        """Close the open window now (the data ran out, or an epoch ended): a short window is divided
        by its own size. Returns its report if it stepped."""
        self._put_back()
        if self._engine.window is None or not self._engine.window.microbatches:
            self._engine.discard()
            return None
        step = FabricStep(self, None)
        self._step(step)
        return step.window

    def _step(self, step: FabricStep) -> None:
        engine, params, world = self._engine, self.params, self._ranks.world_size
        scaler = getattr(self.fabric.strategy.precision, "scaler", None)
        if world > 1:
            closing = engine.close_and_reduce(self._ranks, params)
            grads = gradients.grads_of(params)
            if engine.probe is not None:
                engine.measure_window(self._ranks, grads, closing.scale / _scale(scaler))
        else:
            closing = engine.close(self._ranks, grads=gradients.grads_of(params), loss_scale=lambda: _scale(scaler))
            grads = gradients.grads_of(params)
            engine.measure_window(self._ranks, grads)
        if closing.empty:
            self.optimizer.zero_grad(set_to_none=True)
            engine.advance(self._epoch)
            return
        gradients.scale_(grads, closing.scale)
        if world > 1 and engine.metrics.tracking:  # (made global after the counts: its norm measured now)
            loss_scale = _scale(scaler)
            engine.metrics.add_grad_norm(grads if loss_scale == 1.0 else [g / loss_scale for g in grads])
        if self.clip_val is not None:  # (Fabric unscales an AMP gradient first)
            if self.clip_algorithm == "norm":
                self.fabric.clip_gradients(self.model, self.optimizer, max_norm=self.clip_val, error_if_nonfinite=False)
            else:
                self.fabric.clip_gradients(self.model, self.optimizer, clip_val=self.clip_val)
        engine.scale_lr(self.optimizer)
        try:
            self.optimizer.step()
        finally:
            engine.restore_lr()
        self.optimizer.zero_grad(set_to_none=True)
        engine.advance(self._epoch)
        step.stepped = True
        step.window = report([self.optimizer.optimizer], engine, closing)
        if self.log:  # (Fabric turns a device scalar into a number)
            values = metric_values(step.window)
            self.fabric.log_dict({f"accum/{name}": value for name, value in values.items()}, step=engine.progress.step)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Progress and the open window with its partial gradient (every rank's under DDP): what
        ``fabric.save`` keeps to resume exactly, at a step or inside a window."""
        state = self._engine.state_dict()
        state.update(epoch=self._epoch, batch=self._batch)
        window = state["window"]
        if window is not None and window["microbatches"]:
            state.update(self._partial.save(self._ranks, self._engine.local_numbers(), self.params))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the partial gradient is put back at the next block)."""
        self._engine.load_state_dict(state_dict)
        self._epoch, self._batch = int(state_dict.get("epoch", 0)), int(state_dict.get("batch", 0))
        self._partial.load(state_dict)
        self._resumed = True


def _scale(scaler: Any) -> float:
    return 1.0 if scaler is None else float(scaler.get_scale())


__all__ = ["FabricAccumulator", "FabricStep"]
