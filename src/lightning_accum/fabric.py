"""``FabricAccumulator``: the window engine in a Lightning Fabric loop.

A hand-written Fabric loop accumulates with ``fabric.no_backward_sync`` and ``fabric.backward(loss /
k)`` and steps at every k-th iteration: a fixed k, the mean of per-micro-batch means, no state to
resume a window from. This adapter gives such a loop what the Trainer's adapters give: windows
whose k follows a schedule, normalised by what really went in (token-weighted over micro-batches
and ranks), LR scaling and schedules keyed on progress, clipping of the normalised gradient, window
reports, and a ``state_dict`` that resumes at a step or inside a window.

Strategies, each proved against the float64 reference (any other is refused when the accumulator is
made): one device; DDP, whose micro-batches all skip the gradient sync, the window's gradient then
all-reduced once at its end (after the counts' all-reduce), also when ``flush`` closes a short
window; FSDP2 (``ModelParallelStrategy`` with ``fully_shard``), whose micro-batches before the
window's last skip the sync (``set_requires_gradient_sync``), the last one reduce-scattering the
window's gradient in FSDP2's own backward.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_accum._core import ahead, gradients
from lightning_accum._core.batchnorm import BatchNormMode, WindowBatchNorm, check_batchnorm
from lightning_accum._core.checkpoint import PartialWindow, check_world
from lightning_accum._core.engine import WindowEngine
from lightning_accum._core.errors import NonFiniteWindowError
from lightning_accum._core.metrics import weighted
from lightning_accum._core.options import (
    Count,
    LRScaling,
    Reduction,
    check_callback_items,
    check_clip,
    check_common,
    check_flag,
)
from lightning_accum._core.probe import check_noise_under
from lightning_accum._core.samples import sample_count
from lightning_accum._core.sync import SyncMode
from lightning_accum._core.wide import check_grad_accum_dtype, inert_note, refuse_under
from lightning_accum._core.window import Normalize, Window, batch_counts, check_count, microbatch_items, pass_items
from lightning_accum._fabric.ahead import FabricAhead
from lightning_accum._fabric.guards import WindowGuard, check_same_owner, check_set_up, sync_plan
from lightning_accum._fabric.unflushed import UnflushedWatch
from lightning_accum._lightning import rank_zero_warn
from lightning_accum._trainer.reporting import WindowReport, metric_values, report
from lightning_accum.lr import LRMultiplier
from lightning_accum.multitask import check_loss
from lightning_accum.schedules import Progress, Schedule


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

    def __init__(self, accumulator: FabricAccumulator, counted: int | Tensor | None) -> None:
        self._acc = accumulator
        self._counted = counted  # `count(batch)`, taken when the block opened
        self._declared: int | Tensor | None = None  # the `items=` of the passes that gave one, summed
        self._implicit = 0  # passes without `items=`
        self._open = True
        #: whether the micro-batch closes the window, once decided (``FabricAccumulator._final``); before that, its
        #: samples, the block's ``last`` and its count over ranks if read ahead
        self._ends: bool | tuple[int, bool, int | None] = False
        self._sync: contextlib.ExitStack | None = None  # (FSDP2: where the first backward enters the sync's context)
        self.passes = 0
        self.stepped = False
        self.window: WindowReport | None = None

    def backward(self, loss: Tensor, *, items: int | Tensor | None = None, retain_graph: bool = False) -> None:
        """``fabric.backward`` of ``loss`` into the window: divided by the window's ``k``, and, for a
        mean loss, weighted by its item count: ``count(batch)`` with ``reduction="mean"`` (the
        micro-batch's items, counted once however many passes it makes), or ``items=n`` for this
        pass (``normalize="items"`` only), which adds ``n`` to the window's items. ``retain_graph``:
        keep the graph for another pass through it (as ``Tensor.backward``'s).

        Example:

            with acc.accumulate(batch) as step:
                out = model(**batch)
                step.backward(out.loss, retain_graph=True)       # weighted by count(batch)
                step.backward(aux_loss(out), items=n_aux)         # a second pass, of its own items
        """
        self._acc._backward(self, loss, items, check_flag("retain_graph", retain_graph))

    def _items(self, samples: int) -> int | Tensor:
        return microbatch_items(self._declared, self._implicit > 0, self._counted, samples)


class FabricAccumulator:
    """Exact, scheduled gradient accumulation in a Lightning Fabric loop.

    Args:
        fabric: the ``Fabric``; ``model`` and ``optimizer`` are what ``fabric.setup`` returned.
        model: the Fabric-wrapped module (its gradient sync is skipped inside a window).
        optimizer: the Fabric-wrapped optimizer the windows step.
        schedule: a ``Schedule`` or an ``int`` (epoch-keyed schedules need ``epoch=`` in ``accumulate``).
        normalize: ``"mean"`` (the mean of the micro-batches' gradients over all ranks) or ``"items"``
            (the summed per-item gradient over the window's global item count).
        count: ``count(batch) -> int | Tensor``: a micro-batch's items, taken when its block opens; required
            for ``"items"``.
        reduction: what the loss is over a micro-batch's items with ``"items"``: ``"sum"``, or
            ``"mean"`` (weighted by the count); required with ``"items"``, refused otherwise.
        lr_scaling: ``None``, ``"linear"``, ``"sqrt"`` or ``"adascale"``.
        lr_schedule: a learning-rate multiplier keyed on ``Progress`` (``lightning_accum.lr``).
        gradient_clip_val: clip the normalised window gradient (``fabric.clip_gradients``); ``None`` (the
            default) does not clip. By norm, a window whose gradient is NaN or infinite is refused rather
            than stepped, as ``fabric.clip_gradients`` refuses it: ``NonFiniteWindowError``, a ``RuntimeError``
            (under a ``GradScaler`` the scaler skips it).
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        sync: under FSDP2, ``"auto"`` or ``"skip"`` reduce-scatter once per window (the micro-batches before
            its last keep FSDP2's unsharded gradient: give ``last=True`` to the data's last ``accumulate``),
            ``"every"`` after every micro-batch. DDP always all-reduces once per window.
        log: report each window (``accum/*`` through ``fabric.log_dict``, and ``step.window``).
        batchnorm: ``"micro-batch"`` (BatchNorm's running statistics updated by every forward, as in a plain
            loop) or ``"window"`` (updated once per window with the pooled statistics of its micro-batches; the
            model's layers are hooked from here on, taken over from any earlier accumulator, and the hooks act
            inside ``accumulate`` blocks only: a forward outside one is BatchNorm's own update). See the guide's
            "BatchNorm and accumulation".
        grad_accum_dtype: ``None`` (each window's gradient is summed in ``.grad``, in the parameters' dtype) or
            ``torch.float32`` (also ``"float32"`` / ``"fp32"``): under bf16 or fp16 parameters
            (``Fabric(precision="bf16-true")``) each narrow parameter's window gradient is summed, normalised and
            all-reduced in float32 and rounded to its dtype once, before clipping and the step; between
            micro-batches its ``.grad`` is ``None``. Single device and DDP; see the guide's "The window's precision".

    A loop must end its last window with ``flush()`` (or ``last=True`` on the data's last block): an accumulator
    garbage-collected, or alive when the process ends, with micro-batches in an unstepped window warns once
    (a ``UserWarning``), unless a checkpoint holds that window as it is.

    Example:

        acc = FabricAccumulator(fabric, model, optimizer, Ramp(1, 16, over=2_000_000, unit="items"),
                                normalize="items", count=causal_lm_tokens, reduction="mean")
        for i, batch in enumerate(loader):
            with acc.accumulate(batch, last=i == len(loader) - 1) as step:
                step.backward(model(**batch).loss)
        acc.flush()  # (a no-op after `last=True`) a short last window, divided by its own size
        fabric.save(path, {"accumulation": acc, "model": model, "optimizer": optimizer})
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
        sync: SyncMode = "auto",
        log: bool = True,
        batchnorm: BatchNormMode = "micro-batch",
        grad_accum_dtype: torch.dtype | str | None = None,
    ) -> None:
        check_set_up(fabric, model, optimizer)
        self.grad_accum_dtype = check_grad_accum_dtype(grad_accum_dtype)
        self.schedule = check_common("FabricAccumulator", schedule, normalize, count, lr_scaling, sync, lr_schedule)
        self.reduction = check_callback_items(normalize, count, reduction, "`step.backward(loss)` gets")
        check_clip(gradient_clip_val, gradient_clip_algorithm)
        self.log = check_flag("log", log)
        self.batchnorm = check_batchnorm(batchnorm)  # (every argument checked before a hook is attached)
        self._plan = sync_plan(fabric, model, sync)
        check_same_owner(fabric, model, optimizer)
        check_noise_under(self._plan, self.schedule, lr_scaling)
        refuse_under(self._plan.family, self.grad_accum_dtype, "FabricAccumulator")
        self.fabric, self.model, self.optimizer = fabric, model, optimizer
        self.normalize, self.count = normalize, count
        self.clip_val, self.clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self._engine = WindowEngine(
            self.schedule, normalize, lr_scaling, lr_schedule, self.reduction, grad_accum_dtype=self.grad_accum_dtype
        )
        self._engine.start_fit(self._plan, log)
        self._engine.widen(self.params)  # (the hooks live as long as the accumulator)
        self._groups = gradients.group_sizes(optimizer.optimizer)  # (a group added later is taken as it joins)
        if self.grad_accum_dtype is not None and not self._engine.widened:
            rank_zero_warn(inert_note(self.grad_accum_dtype))
        if batchnorm == "window":  # (the module's own names: a checkpoint's statistics are keyed by them)
            stats = WindowBatchNorm()
            stats.attach(getattr(model, "module", model))
            self._engine.pool_batchnorm(stats)
        # Fabric's own backward (refused to the user inside a block, where the instance's attribute is set)
        self._fabric_backward = functools.partial(type(fabric).backward, fabric)
        self._guard = WindowGuard(fabric, model, optimizer, optimizer.optimizer)
        self._ranks = _Ranks(fabric)
        self._partial = PartialWindow()
        self._resumed = False  # a checkpoint's numbers wait to be put back (at the next block)
        self._block: FabricStep | None = None  # the open `accumulate` block
        self._stuck: str | None = None  # why no window can go on (FSDP2 holds a cut-short pass's gradient)
        self._told_to_load = False  # (FSDP2: how to load the state a sharded checkpoint hands back, said once)
        #: whose progress counter only `epoch=` moves (refused without it)
        self._epoch_keyed = [
            f"{name} {value!r}" for name, value in (("schedule", self.schedule), ("lr_schedule", lr_schedule))
            if getattr(value, "unit", None) == "epoch"
        ]  # fmt: skip
        self._epoch = 0
        self._batch = 0  # micro-batches of the epoch so far
        # `read_ahead`: its loops, and a budget's counts read ahead from them (several ranks, or the test switch)
        # (the engine and the ranks, not `self`: an accumulator dropped is freed at once, where `UnflushedWatch` warns)
        engine, ranks = self._engine, self._ranks
        self._ahead = FabricAhead(lambda: engine.budgeted and (ranks.world_size > 1 or ahead.ON_ONE_PROCESS))
        # warns once if the accumulator is dropped, or the process ends, with micro-batches no step took
        caller = sys._getframe(1)  # (the user's line that made it: where that warning points)
        made_at = (caller.f_code.co_filename, caller.f_lineno)
        self._unflushed = UnflushedWatch(self, self._engine, self._ranks.global_rank, made_at)

    @property
    def progress(self) -> Progress:
        """How far training has come: optimizer steps, samples and items over all ranks, epoch."""
        return self._engine.progress

    @property
    def params(self) -> list[Tensor]:
        """The parameters the windows step (the optimizer's)."""
        return gradients.optimizer_params(self.optimizer.optimizer)

    # ------------------------------------------------------------------ one micro-batch
    def read_ahead(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The loader's batches, for a loop that runs one ``accumulate`` block per batch, in order: under a ``Budget``
        on several ranks, their counts are read ahead and summed over ranks ``CHUNK`` (4) batches per all-reduce, a
        chunk before they are needed, so that a rank waits on no collective inside a window (without it, each
        block's count is summed in an all-reduce issued as the block opens and read at its end, where a rank waits for
        any rank that had not begun the block).

        It holds up to 7 batches beyond the one it yielded last, and counts each as the loader yields it (its samples,
        and ``count(batch)``: the same number the block must get). Its contract, refused where broken: each block in
        the loop runs on the batch the loop yielded last (by identity), at most once; a batch may run no block (every
        rank alike, as always). A new ``read_ahead`` (the next epoch) ends the one before it. Ranks whose loaders end
        at different batches are refused, on every rank, at the first batch one of them lacks. Without a budget, or on
        one process, it only iterates (the contract is still checked). ``flush()``, ``last=True``, ``epoch=`` and
        checkpoints work as without it; a stateful loader's own state (saved by the loop) is up to 7 batches ahead
        of the one trained. The loader must yield a batch that stays as it is until its block (not one object
        refilled); an error it raises comes out where the loop reaches it. Broken out of, a loop over a one-shot
        iterator keeps what it read ahead for a new ``read_ahead`` over the same iterator (warned: reading the
        iterator itself would skip it).

        Example:

            for epoch in range(epochs):
                for batch in acc.read_ahead(loader):
                    with acc.accumulate(batch, epoch=epoch) as step:
                        step.backward(model(**batch).loss)
                acc.flush()
        """
        self._refuse_in_block("`acc.read_ahead(...)`")
        return self._ahead.start(loader, self._ranks, lambda: self._block is not None)

    @contextlib.contextmanager
    def accumulate(self, batch: Any, *, epoch: int | None = None, last: bool = False) -> Iterator[FabricStep]:
        """One micro-batch: ``step.backward(loss)`` inside; the window steps when the block of its
        last micro-batch exits (its ``k``-th, or one given ``last=True``).

        Args:
            batch: the micro-batch (counted when the block opens: its samples, and ``count(batch)``).
            epoch: the epoch the batch belongs to (needed by epoch-keyed schedules; a window does not
                cross epochs: call ``flush()``, or give ``last=True``, at each epoch's end).
            last: the data ends after this micro-batch (the epoch's last): its window closes with it. Under
                FSDP2 the window's last micro-batch must be known before its backward: give it there.

        Inside the block, ``step.backward`` is the only backward pass into the window: ``fabric.backward``,
        ``optimizer.step()`` and ``optimizer.zero_grad()`` are refused until it exits.
        """
        self._refuse_in_block("`acc.accumulate(...)`")
        self._refuse_stuck()
        final = check_flag("last", last)
        self._check_epoch(epoch)
        engine = self._engine
        self._put_back()
        # counted before the block's code can change the batch (e.g. `labels = batch.pop("labels")`); a tensor
        # count is copied, so that a count the batch holds (or a buffer the loader fills again) stays as it was
        samples = sample_count(batch, engine.samples_needed_by)
        counted = None if self.count is None else check_count(self.count(batch))
        if isinstance(counted, Tensor):
            counted = counted.detach().clone()
        total = self._read_ahead(batch, samples, samples if counted is None else counted)
        try:
            window = self._open_window()
        except BaseException:
            self._ahead.give_back(batch)  # (a block may run on it again)
            raise
        engine.batch_start()  # (`batchnorm="window"`: the block's forwards pooled, till it exits)
        # (under a `Budget`: the micro-batch's count over ranks, `count(batch)` or its samples, against the budget:
        # read ahead in a `read_ahead` loop; else its all-reduce goes out now, and is read where the window's end is
        # needed, `_final`)
        if total is None:
            engine.ask(samples, samples if counted is None else counted, self._ranks)
        step = self._block = FabricStep(self, counted)
        step._ends = (samples, final, total)
        self._guard.arm()
        finished = False
        try:
            with self._guard.block(), self._backward_sync(step):
                yield step
            finished = True
        finally:
            step._open, self._block = False, None
            if not finished:
                self._ahead.give_back(batch)  # (a block may run on it again)
                engine.take_back()  # (a budget's count of the micro-batch, which did not go in)
                engine.batch_done()  # (the statistics of its forwards stay out)
                self._abandon(step, self._skipped(step), "An exception inside an `accumulate` block after its "
                              "`step.backward`")  # fmt: skip
        if not step.passes:
            self._ahead.give_back(batch)
            engine.take_back()
            engine.batch_done()  # (the statistics of its forwards stay out)
            self._abandon(step, self._skipped(step), "An `accumulate` block that made no `step.backward`", always=True)
            raise RuntimeError(
                "The `accumulate` block made no `step.backward(loss)`: call it (not `loss.backward()` or "
                "`fabric.backward`) for the micro-batch's loss, so that it is weighted into the window."
            )
        final = self._final(step)  # (a budget's count over ranks, before the micro-batch is counted)
        skip = self._skips_sync(final)
        engine.count(samples, step._items(samples))
        engine.backward_done()
        engine.batch_done()
        window.mark_synced(not skip)
        self._batch += 1
        if final:
            self._step(step)
        elif engine.wants_prefix():  # the noise probe's prefix (`NoiseScale`, AdaScale): this rank's gradient
            engine.measure_prefix(gradients.grads_of(self.params), self._loss_scale())

    def _open_window(self) -> Window:
        """The window the block goes into (opened now if none is), its wide sums kept up with the param groups."""
        engine = self._engine
        if engine.window is None and self.grad_accum_dtype is not None:  # (a param group added, a layer unfrozen)
            engine.rewiden(self.params)
        if engine.wide is not None and gradients.group_sizes(self.optimizer.optimizer) != self._groups:
            self._groups = gradients.group_sizes(self.optimizer.optimizer)  # a param group joined inside a window:
            engine.widen(self.params)  # its narrow parameters' sums too (those held are kept)
        return engine.window or engine.open(self._epoch, self._batch, self._ranks)

    def _final(self, step: FabricStep) -> bool:
        """Whether the block's micro-batch closes the window (its ``k``-th, ``last=True``, or under a ``Budget`` its
        count over ranks, read from the all-reduce issued as the block opened): decided once, where first needed."""
        if isinstance(step._ends, tuple):
            samples, last, total = step._ends
            items = samples if step._counted is None else step._counted
            step._ends = self._engine.closes_after(samples, items, self._ranks, total=total) or last
        return step._ends

    def _read_ahead(self, batch: Any, samples: int, items: int | Tensor) -> int | None:
        """In a ``read_ahead`` loop: the block's batch checked against the loop's, and under a ``Budget`` on several
        ranks its count over ranks, read ahead (``None``: not read ahead)."""
        position = self._ahead.position(batch)
        if position is None or not self._ahead.sums():
            return None
        engine = self._engine
        try:
            total = self._ahead.total(
                position,
                self._ranks,
                lambda: engine.budget_count(samples, items, warn=False),
                lambda b: engine.budget_count(*batch_counts(b, engine.samples_needed_by, self.count)),
            )
            self._ahead.counts.check(position, samples, items, getattr(engine.schedule, "unit", None) == "samples",
                                     "the `accumulate` block")  # fmt: skip
        except BaseException:
            self._ahead.give_back(batch)
            raise
        return total

    @contextlib.contextmanager
    def _backward_sync(self, step: FabricStep) -> Iterator[None]:
        """The block's gradient sync: under DDP skipped for the whole block (entered before its forward, as DDP
        needs); under FSDP2 with the sync skipped, entered at the block's first ``step.backward``, once the window's
        last micro-batch is known under a ``Budget`` (``_final``): its wait on the count then overlaps the block's
        forward."""
        if self._plan.family == "ddp" or not self._plan.skip or not self._engine.budgeted:
            skip = self._skips_sync(self._plan.family != "ddp" and self._plan.skip and self._final(step))
            with self.fabric.no_backward_sync(self.model, enabled=skip):
                yield
            return
        with contextlib.ExitStack() as stack:
            step._sync = stack
            yield

    def _skipped(self, step: FabricStep) -> bool:
        """Whether the block's backward passes skipped the gradient sync (so far as they ran)."""
        if self._plan.family == "ddp" or not self._plan.skip:
            return self._skips_sync(False)
        return isinstance(step._ends, bool) and self._skips_sync(step._ends)

    def _skips_sync(self, final: bool) -> bool:
        """Whether this micro-batch's backward skips the gradient collective: always under DDP (the window is
        all-reduced at its end), before the window's last under FSDP2 (unless ``sync="every"``)."""
        if self._plan.family == "ddp":
            return self._ranks.world_size > 1
        return self._plan.skip and not final

    def _abandon(self, step: FabricStep, skipped: bool, what: str, always: bool = False) -> None:
        """A block ended without its micro-batch counted (it raised, or made no ``step.backward``). If a backward
        pass may have run (``always``: one that went around the window cannot be seen), the micro-batch may be
        partly in the window, which then cannot be stepped exactly: the window is left out (warned), its
        gradient cleared, so that a loop that goes on starts a clean one."""
        window = self._engine.window
        if not (step.passes or always):
            if window is None or not window.microbatches:
                self._guard.disarm()
            return  # nothing of this micro-batch reached the gradient: the window goes on as it was
        held = 0 if window is None else window.microbatches
        self._drop_window()
        warnings.warn(
            f"{what}: the micro-batch may be partly in the window's gradient, so the window ({held} earlier "
            f"micro-batch(es) and this one) was left out and its gradient cleared; the next block starts a clean "
            "window.",
            stacklevel=4,
        )
        if skipped and self._plan.family == "fsdp2":
            self._stuck = (
                "A block ended without its micro-batch under FSDP2 with the gradient sync skipped: FSDP2 holds what "
                "its backward passes made in its own unsharded buffers, which the accumulator cannot clear, and the "
                "next reduce-scatter would add it to the next window. Resume from the last checkpoint saved at a step."
            )

    def _drop_window(self) -> None:
        """Leave the open window out: its counts and gradient gone, the calls around it given back."""
        self._engine.restore_lr()
        self._engine.discard()
        for p in self.params:
            p.grad = None
        self._guard.disarm()

    def _refuse_stuck(self) -> None:
        if self._stuck is not None:
            raise RuntimeError(self._stuck)

    def _refuse_in_block(self, what: str) -> None:
        if self._block is not None:
            raise RuntimeError(
                f"{what} was called inside an `acc.accumulate(batch)` block; call it after the block exits (a block "
                "is one micro-batch: its window steps, and can be saved, between blocks)."
            )

    def _put_back(self) -> None:
        """After ``load_state_dict``, before the window goes on (a block, or ``flush``): this rank's
        part of a window the checkpoint held, and its partial gradient."""
        if self._resumed:
            numbers = self._partial.numbers(self._ranks, self._ranks.global_rank)
            if numbers is not None:
                self._engine.load_local_numbers(numbers)
            self._partial.put_back(self.params, self._engine.wide_sums)
            self._resumed = False

    def _check_epoch(self, epoch: object) -> None:
        if epoch is None:
            if self._epoch_keyed:
                raise ValueError(
                    f"The {' and the '.join(self._epoch_keyed)} is keyed on epochs, which only `epoch=` moves: give "
                    "`acc.accumulate(batch, epoch=e)` and call `acc.flush()` (or give `last=True`) at each epoch's end."
                )
            return
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"`epoch` must be an int >= 0 (the epoch the batch belongs to); got {epoch!r}.")
        epoch = int(epoch)
        if epoch < self._epoch:
            raise ValueError(
                f"`epoch={epoch}` goes back from epoch {self._epoch}: epochs only move forward (after a resume, the "
                "checkpoint's epoch goes on)."
            )
        if epoch != self._epoch:
            if self._engine.window is not None and self._engine.window.microbatches:
                raise RuntimeError(
                    f"Epoch {epoch} began inside a window of epoch {self._epoch}: call `acc.flush()` at each epoch's "
                    "end, or give `last=True` to its last `accumulate` (a window does not cross epochs)."
                )
            self._epoch, self._batch = epoch, 0

    def _backward(self, step: FabricStep, loss: Tensor, items: int | Tensor | None, retain_graph: bool) -> None:
        if not step._open:
            raise RuntimeError(
                "`step.backward` was called after its `accumulate` block exited: the micro-batch was counted (and "
                "its window maybe stepped) then. Call it inside the block."
            )
        loss = check_loss(loss, "the loss passed to `step.backward`")
        window = self._engine.window
        assert window is not None
        if items is not None:
            if self.normalize != "items":
                raise ValueError(
                    "`step.backward(loss, items=n)` weights a mean loss by its item count, which needs "
                    "`normalize='items'`; with `normalize='mean'` every micro-batch counts once: leave `items` out."
                )
            items = check_count(items, "`items=`")
            if isinstance(items, Tensor):  # (kept until the window's end: a copy, as the batch may change)
                items = items.detach().clone()
            step._declared = items if step._declared is None else step._declared + items
        else:
            step._implicit += 1
        if step._sync is not None:  # (FSDP2, the sync skipped: the window's last micro-batch reduce-scatters)
            skip = self._skips_sync(self._final(step))
            step._sync.enter_context(self.fabric.no_backward_sync(self.model, enabled=skip))
            step._sync = None
        step.passes += 1
        # a mean over the micro-batch's items, counted once however many passes; a mean over no items (NaN) adds nothing
        weight = pass_items(items, self.reduction == "mean", step._counted)
        weighed, nothing = weighted(loss, weight)
        self._engine.metrics.add_loss(weighed)
        wide = self._engine.wide_sums
        weighting: contextlib.AbstractContextManager[None]
        if wide is None or weight is None:
            loss, weighting = weighed, contextlib.nullcontext()
        else:  # (`grad_accum_dtype`: the weight on the gradients as they are taken, in the wide dtype)
            weighting = wide.weighting(weight)
        handles = gradients.add_nothing_if(self.params, nothing)
        try:
            with weighting:
                self._fabric_backward(loss / window.divisor, model=self.model, retain_graph=retain_graph)
        finally:
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------ the window's end
    def flush(self) -> WindowReport | None:
        """Close the open window now (the data ran out, or an epoch ended): a short window is divided
        by its own size. Returns its report if it stepped (``None`` if nothing was open, or nothing went
        in: a window of no items is neither stepped nor counted as a step)."""
        self._refuse_in_block("`acc.flush()`")
        self._refuse_stuck()
        self._put_back()
        window = self._engine.window
        if window is None or not window.microbatches:
            self._engine.discard()
            self._guard.disarm()
            return None
        if self._plan.sharded and self._plan.skip and not window.synced:
            raise RuntimeError(
                f"`flush()` cannot close this window under FSDP2: its last micro-batch skipped the gradient sync, so "
                f"FSDP2 still holds the window's {window.microbatches} micro-batch(es) unreduced in its own buffers. "
                "Give `last=True` to the data's last `acc.accumulate(batch, ...)` (its backward then reduce-scatters "
                "and the window steps), or make the accumulator with `sync='every'`."
            )
        step = FabricStep(self, None)
        self._step(step)
        return step.window

    def _step(self, step: FabricStep) -> None:
        self._guard.disarm()
        try:
            self._close_and_step(step)
        except BaseException as error:
            # a window whose step did not finish cannot be stepped again exactly: left out, a clean one next
            window = self._engine.window
            self._drop_window()
            if not isinstance(error, NonFiniteWindowError):  # (whose message says so already)
                warnings.warn(
                    f"The window's step failed ({type(error).__name__}), so the window ("
                    f"{0 if window is None else window.microbatches} micro-batch(es) on this rank) was left out and "
                    "its gradient cleared; the next block starts a clean window.",
                    stacklevel=3,
                )
            raise

    def _close_and_step(self, step: FabricStep) -> None:
        engine, params, world = self._engine, self.params, self._ranks.world_size
        if self._plan.family == "ddp" and world > 1:
            closing = engine.close_and_reduce(self._ranks, params)
            grads = gradients.grads_of(params)
            if engine.probe is not None:
                engine.measure_window(self._ranks, grads, closing.scale / self._loss_scale())
        elif self._plan.sharded:  # (FSDP2 reduce-scattered the window's gradient: a shard's norm is not its norm)
            closing = engine.close(self._ranks)
            grads = gradients.grads_of(params)
        else:
            closing = engine.close(self._ranks, grads=gradients.grads_of(params), loss_scale=self._loss_scale)
            grads = gradients.grads_of(params)
            engine.measure_window(self._ranks, grads)
        if closing.empty:
            self.optimizer.zero_grad(set_to_none=True)
            engine.advance(self._epoch)
            return
        gradients.scale_(grads, closing.scale)
        if engine.widened:  # (the narrow parameters' sums, normalised and rounded once, into `.grad` beside)
            engine.land(closing.scale)
            grads = gradients.grads_of(params)
        if self._plan.family == "ddp" and world > 1 and engine.metrics.tracking:  # (global after the counts)
            loss_scale = self._loss_scale()
            engine.metrics.add_grad_norm(grads if loss_scale == 1.0 else [g / loss_scale for g in grads])
        self._clip(closing.k, closing.microbatches)
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

    def _clip(self, k: int, microbatches: int) -> None:
        """Clip the normalised window gradient through Fabric (which unscales an AMP gradient first). By norm, a
        non-finite gradient is refused as ``fabric.clip_gradients`` refuses it (``NonFiniteWindowError``, a
        ``RuntimeError``), unless a ``GradScaler`` owns it
        (the scaler then skips the step and lowers its scale)."""
        if self.clip_val is None:
            return
        if self.clip_algorithm == "value":
            self.fabric.clip_gradients(self.model, self.optimizer, clip_val=self.clip_val)
            return
        scaler = self._scaler()
        try:
            self.fabric.clip_gradients(
                self.model, self.optimizer, max_norm=self.clip_val, error_if_nonfinite=scaler is None
            )
        except RuntimeError as error:
            if "non-finite" not in str(error):
                raise
            raise NonFiniteWindowError(
                f"The window's gradient is not finite (NaN or infinite; k = {k}, {microbatches} micro-batch(es) over "
                "all ranks), so it was not stepped: `gradient_clip_val` clips by norm, and a non-finite norm is "
                "refused, as `fabric.clip_gradients` refuses it. The window was left out and the next one starts "
                "clean; find the micro-batch whose loss is not finite."
            ) from error

    def _scaler(self) -> Any:
        return getattr(self.fabric.strategy.precision, "scaler", None)

    def _loss_scale(self) -> float:
        scaler = self._scaler()
        return 1.0 if scaler is None else float(scaler.get_scale())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Progress and the open window with its partial gradient (every rank's under DDP): what
        ``fabric.save`` keeps to resume exactly, at a step or inside a window (call it on every rank).
        A window under FSDP2 with the sync skipped is left out, warned: its gradient is in FSDP2's buffers."""
        self._refuse_in_block("`acc.state_dict()`")
        if self._plan.family == "fsdp2" and not self._told_to_load:
            self._told_to_load = True
            rank_zero_warn(
                "Under `ModelParallelStrategy`, `fabric.load` of a sharded checkpoint puts the accumulator's state "
                "into the `state` dict instead of loading it (as it does any object's but the model's and the "
                "optimizers'): after `fabric.load(path, state)`, call `acc.load_state_dict(state['accumulation'])` "
                "if `state['accumulation'] is not acc`, or the resumed run starts its windows from nothing."
            )
        state = self._engine.state_dict()
        state.update(epoch=self._epoch, batch=self._batch)
        window = state["window"]
        if window is not None and window["microbatches"]:
            engine = self._engine
            state.update(self._partial.save(self._ranks, engine.local_numbers(), self.params, engine.wide_sums))
        self._unflushed.kept()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the partial gradient is put back at the next block). A
        checkpoint saved inside a window resumes on as many ranks as it was saved on, and is refused on
        any other number before anything changes."""
        self._refuse_in_block("`acc.load_state_dict(...)`")
        if not isinstance(state_dict, Mapping) or not {"progress", "window"} <= set(state_dict):
            raise ValueError(
                "`load_state_dict` needs what `FabricAccumulator.state_dict()` returned (through `fabric.load(path, "
                f"{{..., 'accumulation': acc}})`); got {type(state_dict).__name__} without 'progress' and 'window'."
            )
        if "grads" in state_dict:
            check_world(state_dict, self._ranks)
        self._engine.check_state(dict(state_dict))  # (before the window under way is given up)
        live = self._engine.window
        held_by_fsdp2 = live is not None and live.microbatches and self._plan.sharded and self._plan.skip
        # the window under way is given up for the checkpoint's (put back at the next block, if it holds one)
        self._drop_window()
        self._engine.load_state_dict(dict(state_dict))
        self._epoch, self._batch = int(state_dict.get("epoch", 0)), int(state_dict.get("batch", 0))
        self._partial.load(state_dict)
        self._unflushed.kept()
        self._resumed, self._stuck = True, None
        if held_by_fsdp2:
            self._stuck = (
                "A checkpoint was loaded while a window was open under FSDP2 with the gradient sync skipped: FSDP2 "
                "holds that window's gradient in its own unsharded buffers, which the accumulator cannot clear, and "
                "the next reduce-scatter would add it to the loaded run. Load the checkpoint in a fresh process (or "
                "between windows)."
            )


__all__ = ["FabricAccumulator", "FabricStep"]
