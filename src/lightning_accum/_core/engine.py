"""The window lifecycle, shared by ``AccumulationScheduler`` and ``AccumulationMixin``.

One ``WindowEngine`` drives one window group (the optimizers that step together) through
schedule -> ``Window`` -> local counts, and at the window's end (``close``) global counts (one record, one
all-reduce through the strategy, one host read) -> gradient scale -> LR factor -> window losses -> ``Closing``,
then ``Progress``; it holds that state for checkpoints. It imports no Lightning: the callback and the mixin translate
Lightning's hooks (or the ``accumulate`` block) into calls of ``open``, ``count``,
``close`` and ``advance``, and act on the gradient themselves where Lightning lets them.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum._core import collectives, sync
from lightning_accum._core.batchnorm import WindowBatchNorm
from lightning_accum._core.gradients import norms, squared_norm
from lightning_accum._core.metrics import WindowMetrics, window_losses
from lightning_accum._core.probe import NoiseProbe, measured
from lightning_accum._core.wide import WideSums, dtype_name
from lightning_accum._core.window import Window, check_count, check_item_count, lr_factor, wide_divisor
from lightning_accum.lr import LRMultiplier, adascale_gain, check_multiplier
from lightning_accum.noise import NoiseScale, NoiseScaleEstimator
from lightning_accum.schedules import Budget, Progress, Schedule


class Closing(NamedTuple):
    """A window being stepped: its global counts and the factors for its step.

    Attributes:
        k: micro-batches the schedule gave the window.
        empty: nothing went in over all ranks (no micro-batch, or no item with ``"items"``): no step.
        microbatches: micro-batches back-propagated, over all ranks.
        samples: samples, over all ranks.
        items: items, over all ranks.
        extra: the caller's extra integers, summed over ranks in the same collective.
        scale: the factor that turns the accumulated gradient into the window's normalised one.
        lr_factor: the learning-rate multiplier for this step (``lr_scaling``, ``lr_schedule``).
        gain: AdaScale's gain for this step (1 without it): what it adds to ``Progress.scaled_steps``.
        losses: the window's loss (``"loss"``) and its tasks', over all ranks, while tracking.
        norm_sq: the squared norm of the window's normalised gradient, where it was measured at the close.
    """

    k: int
    microbatches: int
    samples: int
    items: int
    extra: tuple[int, ...]
    scale: float
    lr_factor: float
    empty: bool
    gain: float = 1.0
    losses: dict[str, float] | None = None
    norm_sq: float | None = None


class Counts(NamedTuple):
    """A window's counts over all ranks, and what was read with them (``WindowEngine.close``'s first step).

    Attributes:
        world: the ranks that average gradients (1 on one device).
        microbatches: micro-batches back-propagated, over all ranks.
        samples: samples, over all ranks.
        items: items, over all ranks.
        extra: the caller's extra integers, summed over ranks in the same collective.
        losses: the window's losses' sums over all ranks, by name (``None``: not read).
        norms: the norms of the window's gradient (each a part of it; ``None``: not measured).
    """

    world: int
    microbatches: int
    samples: int
    items: int
    extra: tuple[int, ...]
    losses: dict[str, float] | None
    norms: list[float] | None


def samples_needed_by(schedule: Schedule, normalize: str, lr_scaling: str | None) -> str | None:
    """What needs each micro-batch's sample count, named for an error (``None``: nothing does): a
    schedule keyed on samples, or the gradient noise (``NoiseScale``, AdaScale) measured in samples."""
    if schedule.unit == "samples":
        return f"The schedule {schedule!r}"
    measures = isinstance(schedule, NoiseScale) or lr_scaling == "adascale"
    if measures and normalize == "mean":
        return "Measuring the gradient noise in samples (`normalize='mean'`)"
    return None


def window_id(epoch: int, start: int) -> list[int]:
    """A window's identity (of its epoch and first micro-batch) and its square: small integers, exact in the
    float64 count all-reduce, whose sums over ranks tell whether every rank closes the same window."""
    ident = (epoch * 1_000_003 + start) % 65_521 + 1
    return [ident, ident * ident]


class WindowEngine:
    """One window group's lifecycle and state.

    Args:
        schedule: gives ``k`` when a window opens.
        normalize: ``"mean"`` or ``"items"`` (see ``Window.gradient_scale``).
        lr_scaling: ``None``, ``"linear"``, ``"sqrt"`` or ``"adascale"`` (the gain from the noise
            statistics the window measures; ``adascale_gain``).
        lr_schedule: ``lr_schedule(progress) -> float``, a learning-rate multiplier for the step of
            the window that opened at ``progress`` (see ``lightning_accum.lr``).

    Example:

        >>> from lightning_accum import Constant
        >>> engine = WindowEngine(Constant(2))
        >>> window = engine.open(epoch=0, start=0)
        >>> engine.count(samples=4, items=4); engine.count(samples=4, items=4)
        >>> engine.close(strategy=None).scale  # each loss was divided by k = 2: nothing left to do
        1.0
        >>> engine.advance(epoch=0).samples
        8
    """

    def __init__(
        self,
        schedule: Schedule,
        normalize: str = "mean",
        lr_scaling: str | None = None,
        lr_schedule: LRMultiplier | None = None,
        reduction: str | None = None,
        grad_accum_dtype: torch.dtype | None = None,
    ) -> None:
        self.plan = sync.SyncPlan()
        self._sharded = False  # (`plan.sharded`, read once per fit: the window's end asks it)
        self.progress = Progress()
        self.window: Window | None = None
        self.first_k: int | None = None
        self.first_units: int | None = None  # the first stepped window's samples (or items): AdaScale's base batch
        self.adascale = NoiseScaleEstimator()  # AdaScale's noise estimates when the schedule measures none
        self.closing: Closing | None = None  # set between `close` and `advance`
        self._warned_empty = False
        self._warned_device = False  # (a budget's device counts: warned once)
        self._asked: collectives.HostSum | None = None  # a budget's count over ranks, issued by `ask`, unread
        #: the micro-batch under way: its counts once counted, and whether its backward pass finished
        self.inflight: tuple[int, int | Tensor] | None = None
        self.backward_finished = False
        #: the micro-batch under way ran no backward pass, and its forwards' BatchNorm statistics are in the window
        self.pooled_alone = False
        #: a batch (epoch, index) whose gradient is in the window already, which Lightning trains again
        #: after a resume from a checkpoint written on an exception: it must then add nothing
        self.redo: tuple[int, int] | None = None
        self._scaled_lrs: list[tuple[dict[str, Any], Any]] = []
        self._lr_multiplier: float | None = None  # `lr_schedule`'s, asked when the open window opened
        self.metrics = WindowMetrics()  # the windows' losses, while logging
        #: the learning rates the closing window's step used: (optimizer, each group's LR)
        self.used_lrs: list[tuple[Any, list[Any]]] = []
        #: the host seconds from the previous stepped window's end (the fit's start for the first) to the last one's
        self.seconds: float | None = None
        self._clock: float | None = None  # (the host clock at the last stepped window's end, from a fit's start)
        #: `batchnorm="window"`: the BatchNorm statistics that advance with this engine's windows
        self.batchnorm: WindowBatchNorm | None = None
        #: `grad_accum_dtype`: the narrow parameters' window sums (`widen`), and the parameters the engine steps
        self.wide: WideSums | None = None
        self._scope: list[Tensor] | None = None
        #: whether some parameter's window sum is kept in ``grad_accum_dtype`` (its losses then reach backward
        #: undivided, and the whole division is the close's, in the wide dtype; an attribute: the hot path reads it)
        self.widened = False
        self.configure(schedule, normalize, lr_scaling, lr_schedule, reduction, grad_accum_dtype)

    def pool_batchnorm(self, stats: WindowBatchNorm | None) -> None:
        """``batchnorm="window"``: ``stats`` take each micro-batch whose backward finished, and step with the
        window (``None``: BatchNorm is left to itself)."""
        self.batchnorm = stats

    def widen(self, params: Sequence[Tensor], sums: WideSums | None = None) -> None:
        """At a fit's start: ``params`` (those the engine's windows step) have the window sums of their narrow ones
        kept in ``grad_accum_dtype`` (``WideSums``; ``sums``: ones attached already, that several engines share);
        nothing without it. Sums held from before are kept."""
        if self.grad_accum_dtype is None:
            self.wide, self._scope, self.widened = None, None, False
            return
        if sums is not None:
            self.wide = sums
        else:
            if self.wide is None or self.wide.dtype != self.grad_accum_dtype:
                self.wide = WideSums(self.grad_accum_dtype)
            self.wide.attach(params)
        self._scope, self.widened = list(params), self.wide.active

    def rewiden(self, params: Sequence[Tensor]) -> bool:
        """As a window opens (no sum held): under ``grad_accum_dtype``, ``params``' narrow trainable ones taken again if
        they changed since ``widen`` (a param group added mid-fit, as ``BaseFinetuning`` does, or a parameter unfrozen);
        whether they did. Not for sums several engines share (the mixin's ``MixinWindows.rewiden``)."""
        if self.grad_accum_dtype is None or self.wide is None or not self.wide.stale(params):
            return False
        self.widen(params)
        return True

    @property
    def wide_sums(self) -> WideSums | None:
        """Where ``grad_accum_dtype`` keeps the window's narrow sums (``None``: nowhere, ``.grad`` holds it all)."""
        return self.wide if self.widened else None

    def unwiden(self) -> None:
        """At a fit's end: no more gradients taken into the sums (those held are kept, for a checkpoint)."""
        if self.wide is not None:
            self.wide.detach()

    def _with_sums(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """``grads`` (the wide parameters' ``.grad``) and the narrow parameters' sums: the window's gradient."""
        return [*grads, *self.wide.sums(self._scope)] if self.widened else list(grads)  # type: ignore[union-attr]

    def land(self, scale: float, params: Sequence[Tensor] | None = None) -> None:
        """Under ``grad_accum_dtype`` (``widened``), the closing window's step: each narrow parameter's sum (of
        ``params``, else all the engine steps) times ``scale`` in the wide dtype, rounded into ``.grad`` once (the
        adapters scale the other parameters' ``.grad`` by the same ``scale``)."""
        if self.wide is not None:
            self.wide.land(scale, self._scope if params is None else params)

    def start_fit(self, plan: sync.SyncPlan, track: bool) -> None:
        """What a fit gives: its sync plan, and whether the windows' losses are tracked (for logging)."""
        self.plan, self._sharded = plan, plan.sharded
        self.metrics.tracking = track
        self._clock, self.seconds = time.perf_counter(), None

    def configure(
        self,
        schedule: Schedule,
        normalize: str,
        lr_scaling: str | None,
        lr_schedule: LRMultiplier | None = None,
        reduction: str | None = None,
        grad_accum_dtype: torch.dtype | None = None,
    ) -> None:
        """Set (or change, keeping progress and the open window) what the engine computes with."""
        self.schedule, self.normalize, self.lr_scaling = schedule, normalize, lr_scaling
        self.grad_accum_dtype = grad_accum_dtype  # (the sums follow at the next `widen`)
        self.reduction = reduction  # (with `normalize`: what an open window's partial gradient is a sum of)
        self.lr_schedule, self._lr_multiplier = lr_schedule, None
        self.probe: NoiseProbe | None = None
        if isinstance(schedule, NoiseScale):
            self.probe = NoiseProbe(schedule, normalize)
        elif lr_scaling == "adascale":
            self.probe = NoiseProbe(self.adascale, normalize)
        #: what needs each micro-batch's sample count, if anything (else an unknown count is 0)
        self.samples_needed_by = samples_needed_by(schedule, normalize, lr_scaling)
        self.budgeted = isinstance(schedule, Budget)  # (windows closed by their count: the hot path asks this)

    # ------------------------------------------------------------------ one window
    def open(self, epoch: int, start: int, strategy: Any = None) -> Window:
        """Open a window at batch index ``start`` of ``epoch``, with the ``k`` the schedule gives now
        (checked to be the same on every rank of ``strategy`` unless the schedule guarantees it)."""
        if self.progress.epoch != epoch:
            self.progress = dataclasses.replace(self.progress, epoch=epoch)
        k = self.schedule(self.progress)
        budget = self.schedule.budget(self.progress) if self.budgeted else None  # type: ignore[attr-defined]
        if not self.schedule.rank_consistent and strategy is not None:
            collectives.check_same_k(strategy, k if budget is None else budget, self.schedule)
        # keyed on the progress the window opens with: asked now, so that a bad multiplier is refused before any
        # micro-batch goes in
        self._lr_multiplier = None if self.lr_schedule is None else self._multiplier()
        if self.first_k is None:  # (under a budget, the first window's budget: what `lr_scaling` is relative to)
            self.first_k = k if budget is None else budget
        if budget is None and not self.widened:
            self.window = Window(k=k, start=start, divisor=k)  # each loss reaches backward divided by k
        elif budget is None:  # (`grad_accum_dtype`: each loss divided exactly; the sum divided by k in the wide dtype)
            self.window = Window(k=k, start=start, divisor=wide_divisor(k))
        else:  # (the window's size is known at its close only: its gradient is divided then)
            self.window = Window(k=k, start=start, divisor=1, budget=budget)
        self.closing = None
        self.metrics.clear()
        self.used_lrs = []
        return self.window

    def ask(self, samples: int, items: int | Tensor, strategy: Any) -> None:
        """Under a ``Budget``, as a micro-batch opens (``samples``, ``items``: its counts): its count's all-reduce
        over ranks goes out without waiting for it (``collectives.HostSum``), and the ``closes_after`` that follows
        reads it, after the micro-batch's work has overlapped the other ranks' arrival. Nothing without a budget."""
        if self.budgeted:
            self._asked = collectives.HostSum(strategy, [self.budget_count(samples, items)])

    def closes_after(
        self, samples: int, items: int | Tensor, strategy: Any, *, again: bool = False, total: int | None = None
    ) -> bool:
        """Under a ``Budget``: whether the open window closes after the micro-batch about to go in (``samples``,
        ``items``: its counts, before ``count``), its budget reached over all ranks or ``max_k`` micro-batches in;
        its count over ranks is added to the window's: ``total`` where it is known already (read ahead), else the
        all-reduce ``ask`` issued for it, else one blocking host all-reduce of one integer (none on one process).
        ``again``: the micro-batch is in the window already (trained again after a resume): nothing is added.
        Without a budget: whether it is the window's ``k``-th micro-batch."""
        window = self.window
        assert window is not None
        asked, self._asked = self._asked, None
        if window.budget is None:
            return window.microbatches + (not again) >= window.k
        if again:
            return window.ends
        if total is None:
            total = asked.result()[0] if asked is not None else collectives.host_sum(
                strategy, self.budget_count(samples, items)
            )  # fmt: skip
        return window.reach(total)

    def budget_count(self, samples: int, items: int | Tensor, *, warn: bool = True) -> int:
        """A micro-batch's count in the budget's unit, on the host (a device count read: warned once, with ``warn``)."""
        if getattr(self.schedule, "unit", None) == "samples":
            return samples
        if not isinstance(items, Tensor):
            return items if type(items) is int and items >= 0 else check_item_count(items)
        if items.device.type != "cpu" and warn and not self._warned_device:
            self._warned_device = True
            warnings.warn(
                f"The budget {self.schedule!r} closes each window on its count over all ranks, so every micro-batch's "
                f"count is read on the host before its `training_step`; `count(batch)` gave a tensor on "
                f"{items.device}, whose read waits for the device (one synchronisation per micro-batch). Return a "
                "Python int, or a count on the CPU (e.g. computed in the collate function), to avoid it; this is "
                "only warned once.",
                stacklevel=4,
            )
        return check_item_count(check_count(items).item())  # type: ignore[union-attr]

    def count(self, samples: int, items: int | Tensor) -> None:
        """Count one back-propagated micro-batch into the open window (before its backward pass)."""
        assert self.window is not None
        self.window.add(samples, items)
        self.inflight, self.backward_finished = (samples, items), False

    def batch_start(self) -> None:
        """A micro-batch begins (``batchnorm="window"``: its training forwards are pooled, till it ends)."""
        if self.batchnorm is not None:
            self.batchnorm.arm()

    def pass_ended(self) -> None:
        """Autograd's own mark (``lightning_accum._seam.at_pass_end``): the counted micro-batch's backward pass ran to
        its end, so its gradient is whole in ``.grad``, whatever raises before the adapter's ``backward_done`` (a
        callback's ``on_after_backward`` listed before the package's); ``settle`` then keeps the micro-batch."""
        self.backward_finished = True

    def backward_done(self) -> None:
        """The counted micro-batch's backward pass finished: its gradient (and loss) is in the window."""
        self.backward_finished = True
        if self.batchnorm is not None:  # its statistics in (not a batch trained again: uncounted); the hooks rest
            if self.inflight is not None:
                self.batchnorm.accept()
            else:
                self.batchnorm.drop_pending()
        if self.metrics.tracking:  # (else nothing was added)
            self.metrics.commit()

    def ran_without_backward(self) -> None:
        """The micro-batch under way ran to its end without a backward pass (a ``training_step`` that returned
        ``None``, a block that made none): its training forwards count all the same, once, so their BatchNorm
        statistics join the window (``batchnorm="window"``); the hooks rest."""
        if self.batchnorm is not None:
            self.batchnorm.accept()
            self.pooled_alone = True

    def take_back(self) -> None:
        """Under a ``Budget``: the micro-batch asked about (``closes_after``) did not go in (an exception before it was
        counted): its count leaves the window's, so that it counts once if it comes again (a count ``ask`` issued for
        it that nobody read is dropped)."""
        self._asked = None
        if self.window is not None:
            self.window.unreach()

    def batch_done(self) -> None:
        """The batch is over (nothing of it can be trained again)."""
        self.inflight, self.redo = None, None
        if self.budgeted and self.window is not None:  # (a budget's count of it stays, whether it went in or not)
            self.window.keep_reach()
        if self.batchnorm is not None:  # (`microbatch_over`, inline: the hot path)
            self.batchnorm.drop_pending()
            self.pooled_alone = False

    def microbatch_over(self) -> None:
        """The micro-batch ended (its block exited, or raised): BatchNorm statistics of forwards it did not put in
        the window are dropped, a layer whose forward raised gets its own buffers back, the hooks rest."""
        if self.batchnorm is not None:
            self.batchnorm.drop_pending()

    def keep_finished_pieces(self) -> None:
        """A micro-batch cut short whose finished pieces' gradient stays in the window (a checkpoint holds it): their
        BatchNorm statistics join the window too."""
        if self.batchnorm is not None:
            self.batchnorm.accept_held()

    def wants_prefix(self) -> bool:
        """Whether the noise probe measures after the micro-batch just counted (1, 4, 16, ...):
        asked before gathering the gradients and the AMP scale (a host sync) for it."""
        return self.probe is not None and self.window is not None and measured(self.window.microbatches)

    def measure_prefix(self, grads: Sequence[Tensor], loss_scale: float = 1.0) -> None:
        """Noise probe: the gradient after a micro-batch that is not the window's last (where
        ``wants_prefix``)."""
        assert self.probe is not None and self.window is not None
        self.probe.prefix(self._with_sums(grads), self.window, loss_scale)

    def close(
        self,
        strategy: Any,
        extra: Sequence[int] = (),
        grads: Sequence[Tensor] | None = None,
        loss_scale: Callable[[], float] = lambda: 1.0,
        *,
        losses: bool = True,
        norm: bool = True,
    ) -> Closing:
        """The window's global counts (with ``extra``) and its step's factors, with its losses while
        tracking, in one all-reduce and one host read. ``grads``: the window's gradient if it is global
        already (times the AMP ``loss_scale()``), whose norm is then measured in the same read.
        ``losses``, ``norm``: whether anyone reads the window's loss and its gradient's norm (every rank
        must ask alike); where nobody does, neither is computed, and a window of host counts on one device
        reads nothing at all.

        The steps: global counts (``_global_counts``) -> gradient scale (``Window.gradient_scale``) -> LR factor
        (``_lr_factor``) -> window losses (``metrics.window_losses``) -> the ``Closing``."""
        window = self.window
        assert window is not None
        counts = self._global_counts(strategy, window, extra, grads, losses, norm)
        scale = window.gradient_scale(
            self.normalize, world_size=counts.world, global_microbatches=counts.microbatches, global_items=counts.items
        )
        norm_sq = None if counts.norms is None else math.fsum(n * n for n in counts.norms) * (scale / loss_scale()) ** 2
        mean = self.normalize == "mean"
        over = counts.microbatches if mean else counts.items  # what the window's gradient and loss are a mean over
        units = counts.samples if mean else counts.items  # (AdaScale's batch)
        empty = not (counts.microbatches and over)  # nothing went in over all ranks: no step
        factor, gain = self._lr_factor(window, counts, units, empty)
        per_window = None if counts.losses is None else window_losses(counts.losses, over)
        k = window.k if window.budget is None else window.microbatches  # (a budget's: the micro-batches it took)
        self.closing = Closing(
            k, counts.microbatches, counts.samples, counts.items, counts.extra, scale, factor, empty, gain, per_window,
            norm_sq,
        )  # fmt: skip
        if empty:
            self._warn_empty(counts.microbatches)
        return self.closing

    def _global_counts(
        self, strategy: Any, window: Window, extra: Sequence[int], grads: Sequence[Tensor] | None, losses: bool,
        norm: bool,
    ) -> Counts:  # fmt: skip
        """The window's end, step 1: its counts over all ranks (with ``extra``), its losses' sums where read and its
        gradient's norms where measured: one record, one collective (none on one device) and one host read (none where
        nothing is a tensor). On one device the counts are the window's own, on several ranks they are summed over
        them (``_sum_over_ranks``); the rest is alike."""
        if self._sharded:
            sync.check_window_synced(self.plan, window)
        tracking = self.metrics.tracking
        read_losses = losses and tracking
        grad_norms = None
        if grads is not None and ((norm and tracking) or self.probe is not None):
            grad_norms = norms(self._with_sums(grads))
        world = collectives.world_size(strategy)
        if world > 1:
            return self._sum_over_ranks(strategy, world, window, extra, grad_norms, read_losses)
        sums: dict[str, float] | None = None
        norms_read: list[float] | None = None if grad_norms is None else []  # (measured, with nothing to measure)
        if read_losses or grad_norms or window.pending_items or self.probe is not None:
            sums, norms_read = self._read_here(window, grad_norms, read_losses)
        return Counts(1, window.microbatches, window.samples, window.items, tuple(extra), sums, norms_read)

    def _read_here(
        self, window: Window, grad_norms: list[Tensor] | None, read_losses: bool
    ) -> tuple[dict[str, float] | None, list[float] | None]:
        """One device: the window's losses (each micro-batch's read as it is, summed exactly), its gradient's norms,
        its tensor counts (then added to its counts) and the noise probe's prefixes, in one host read."""
        measured, pending, prefixes = grad_norms or (), window.pending_items, None
        tensors = [*measured, *pending]
        if self.probe is not None:  # (its prefixes: device scalars, and batch sizes the host holds, not read)
            prefixes = self.probe.pending()
            tensors += [p for p in prefixes if isinstance(p, Tensor)]
        sums, values = self.metrics.read(tensors) if read_losses else (None, collectives.host_values(tensors))
        n, m = len(measured), len(measured) + len(pending)
        if pending:
            window.settle_items(values[n:m])
        if prefixes:
            read = iter(values[m:])
            self.probe.settle([next(read) if isinstance(p, Tensor) else float(p) for p in prefixes])  # type: ignore[union-attr]
        return sums, None if grad_norms is None else values[:n]

    def _sum_over_ranks(
        self, strategy: Any, world: int, window: Window, extra: Sequence[int], grad_norms: list[Tensor] | None,
        read_losses: bool,
    ) -> Counts:  # fmt: skip
        """Several ranks: the window's counts, ``extra``, its identity and its losses' sums summed over them in one
        all-reduce, read with this rank's tensor counts, gradient norms and noise prefixes in one host read; the
        ranks must close the same window (else all raise)."""
        names = self.metrics.names() if read_losses else []
        # which window each rank closes, in the same collective: ranks whose windows differ (a rank's data ran out
        # first, an exception one rank caught) fail together rather than mix their windows
        ident = window_id(self.progress.epoch, window.start)
        losses = self.metrics.sums() if read_losses else []
        summed = [window.microbatches, window.samples, window.items_on_device(), *extra, *ident, *losses]
        local: list[collectives.Value] = [list(window.pending_items), [] if grad_norms is None else grad_norms]
        local.append([] if self.probe is None else self.probe.pending())
        read, (items, grad_read, prefixes) = collectives.sum_over_ranks(strategy, summed, local)  # type: ignore[misc]
        counts = [round(v) for v in read[: 3 + len(extra)]]
        collectives.check_same_window(strategy, *read[3 + len(extra) : 5 + len(extra)])
        window.settle_items(items)  # type: ignore[arg-type]
        if self.probe is not None:
            self.probe.settle(prefixes)  # type: ignore[arg-type]
        sums = dict(zip(names, read[5 + len(extra) :], strict=True)) if read_losses else None
        norms_read = None if grad_norms is None else cast("list[float]", grad_read)
        return Counts(world, counts[0], counts[1], counts[2], tuple(counts[3:]), sums, norms_read)

    def _lr_factor(self, window: Window, counts: Counts, units: int, empty: bool) -> tuple[float, float]:
        """The window's end, step 3: the learning-rate factor of its step (``lr_scaling``'s rule, ``window.lr_factor``;
        or AdaScale's gain), times ``lr_schedule``'s multiplier, and AdaScale's gain (1 without it). ``units``: the
        window's samples (``"mean"``) or items, the first stepped window's kept as AdaScale's base."""
        if self.first_units is None and not empty:  # (AdaScale's base: the first window stepped)
            self.first_units = units
        factor = gain = 1.0
        if self.lr_scaling == "adascale" and self.probe is not None:  # from the windows measured before this one
            factor = gain = adascale_gain(self.probe.estimator, units, self.first_units or units)
        elif self.lr_scaling is not None:  # (a budget window: its count over the first window's budget)
            unit = None if window.budget is None else self.schedule.unit
            factor = lr_factor(self.lr_scaling, unit, window.k, counts.samples, counts.items, self.first_k)
        if self.lr_schedule is not None:  # (a window a checkpoint held was not opened here: asked now)
            factor *= self._multiplier() if self._lr_multiplier is None else self._lr_multiplier
        return factor, gain

    def _multiplier(self) -> float:
        """``lr_schedule``'s multiplier for the window opened at ``progress``, checked."""
        assert self.lr_schedule is not None
        return check_multiplier(self.lr_schedule(self.progress), self.lr_schedule, self.progress)

    def close_and_reduce(self, strategy: Any, params: Sequence[Tensor]) -> Closing:
        """``close`` where the package makes the window's gradient global itself (the mixin and Fabric
        loops under DDP, every backward's sync skipped): the counts' all-reduce also says on how many
        ranks each parameter has a gradient, then the gradient is all-reduced in flat buckets, one round."""
        wide = self.wide_sums
        held = [p.grad for p in params] if wide is None else wide.current(params)
        closing = self.close(strategy, [int(g is not None) for g in held])
        collectives.all_reduce_gradients(strategy, params, closing.extra, None if wide is None else wide.slot_of)
        return closing

    def measure_window(self, strategy: Any, grads: Sequence[Tensor] = (), factor: float = 1.0) -> None:
        """Noise probe: the closing window's normalised gradient (measured at the close, else
        ``grads * factor``: one host read)."""
        if self.probe is not None and self.closing is not None:
            c = self.closing
            final_sq = c.norm_sq if c.norm_sq is not None else float(squared_norm(self._with_sums(grads))) * factor**2
            self.probe.window_end(strategy, final_sq, [c.microbatches, c.samples, c.items])

    def _warn_empty(self, microbatches: int) -> None:
        if self._warned_empty:
            return
        self._warned_empty = True
        what = "no micro-batch was back-propagated" if not microbatches else "its global item count is 0"
        warnings.warn(
            f"An accumulation window was not stepped: {what} (over all ranks). Its gradient would be zero or stale, "
            "and a step would still move the optimizer's state (Adam's moments); this is only warned once.",
            stacklevel=3,
        )

    def advance(self, epoch: int) -> Closing:
        """After the step: add the closed window to ``progress`` and forget it. An empty window
        (not stepped) adds its samples and items but no step."""
        closing, window = self.closing, self.window
        assert closing is not None and window is not None
        progress = self.progress
        self.progress = Progress(  # (epoch, step, samples, items, microbatches, scaled_steps)
            epoch,
            progress.step + (not closing.empty),
            progress.samples + closing.samples,
            progress.items + closing.items,
            progress.microbatches + window.microbatches,
            progress.scaled_steps + (0.0 if closing.empty else closing.gain),
        )
        if not closing.empty and self._clock is not None:
            now = time.perf_counter()
            self.seconds, self._clock = now - self._clock, now
        self.window, self.closing = None, None
        if self.wide is not None:  # (landed already if it stepped)
            self.wide.clear(self._scope)
        if self.batchnorm is not None:
            self.batchnorm.commit()
        return closing

    def settle(
        self, batch: tuple[int, int], *, processed: bool, in_backward: bool, open_pass: bool, rescaled: bool
    ) -> str | None:
        """After an exception: the state a checkpoint written now must hold (``lightning_accum._trainer.recovery``).
        ``batch``: (epoch, index) of the batch under way; ``processed``: Lightning will not train it again;
        ``open_pass``: a backward pass ran in a block that did not finish (the mixin); ``rescaled``: a closing
        window's gradient was changed in place for its step. Returns what a checkpoint written now loses,
        if anything."""
        self._finish_pass(in_backward)
        if processed:  # the batch is done: a closing window's step too
            self.inflight, self.pooled_alone = None, False
            if self.closing is not None:
                self.advance(batch[0])
            self.redo = None
            return None
        if self.closing is not None and not rescaled:
            self.closing = None  # the step had not touched the gradient: the window is as it was
        window, inflight = self.window, self.inflight
        self.inflight = None
        # (a micro-batch that ran no backward, whose forwards' BatchNorm statistics are in the window: trained again,
        # it adds nothing, and a budget keeps its count)
        alone, self.pooled_alone = self.pooled_alone and window is not None, False
        if alone:
            window.keep_reach()  # type: ignore[union-attr]
        self.take_back()  # (a budget's count of a micro-batch not counted: it comes again)
        stepping = self.closing is not None  # (and its gradient changed in place for the step)
        cut_short = stepping or in_backward or open_pass  # (a step, or a backward pass, the exception stopped inside)
        if inflight is None and not cut_short:
            if alone:
                self.redo = batch
            return None  # nothing of this batch reached the window (a batch trained again adds nothing)
        if window is None:
            return "this batch's accumulation window was stepped already, and the batch will be trained again"
        if not cut_short:
            self._take_back_batch(batch, window, inflight)  # type: ignore[arg-type]
            return None
        return self._drop_cut_short(window, stepping)

    def _finish_pass(self, in_backward: bool) -> None:
        """After an exception, first: a backward pass that ran to its end (autograd's mark, ``pass_ended``) whose
        adapter's hook after it had not run puts the micro-batch in the window, its BatchNorm statistics and loss too
        (done already: nothing changes); BatchNorm's buffers go back to the window's start, the failed micro-batch's
        statistics out."""
        if self.inflight is not None and self.backward_finished and not in_backward:
            self.backward_done()
        if self.batchnorm is not None:
            self.batchnorm.recover()
            self.batchnorm.drop_pending()

    def _take_back_batch(self, batch: tuple[int, int], window: Window, inflight: tuple[int, int | Tensor]) -> None:
        """The batch under way, which Lightning trains again, outside a backward pass: if its gradient is in the
        window it adds nothing when trained again, else its counts and loss leave the window."""
        if self.backward_finished:
            self.redo = batch  # trained again, it adds nothing
        else:
            window.remove(*inflight)
            self.metrics.drop()

    def _drop_cut_short(self, window: Window, stepping: bool) -> str | None:
        """A step or a backward pass into ``window`` cut short: the window is dropped (what a checkpoint written now
        loses, said), unless no micro-batch's gradient went in before this one's."""
        lost = window.microbatches
        if not (lost or stepping):
            # no micro-batch's gradient went in before this one, which is trained again from its start: the window goes
            # on as it was (its start, a budget's count and the BatchNorm statistics of micro-batches that ran no
            # backward kept), without what this one left (its loss, a wide sum; its `.grad` is in no checkpoint)
            self.metrics.drop()
            if self.wide is not None:
                self.wide.clear(self._scope)
            return None
        self.discard()
        what = "the accumulation window was being stepped" if stepping else (
            "a backward pass into the accumulation window was cut short"
        )  # fmt: skip
        return f"{what}: a checkpoint written now leaves its {lost} micro-batch(es) out"

    def discard(self) -> None:
        """Forget the open window without stepping (nothing went in, or the loop stopped inside it):
        its losses and the noise probe's measurements of it too."""
        self.window, self.closing, self.inflight, self.redo, self._asked = None, None, None, None, None
        self.metrics.clear()
        if self.wide is not None:
            self.wide.clear(self._scope)
        if self.probe is not None:
            self.probe.forget()
        if self.batchnorm is not None:
            self.batchnorm.discard()

    @property
    def noise_scale(self) -> float | None:
        """The ``NoiseScale`` schedule's current estimate, ``None`` for other schedules."""
        return None if self.probe is None else self.probe.estimator.noise_scale

    # ------------------------------------------------------------------ learning rate
    def scale_lr(self, optimizer: Optimizer, keep: bool = True) -> None:
        """Multiply every group's learning rate by the closing window's factor, for its step only
        (and, with ``keep``, keep the rates it steps with in ``used_lrs``, for its report: a tensor rate copied,
        as a scheduler changes it in place after the step)."""
        factor = 1.0 if self.closing is None else self.closing.lr_factor
        if factor != 1.0:
            for group in optimizer.param_groups:
                self._scaled_lrs.append((group, group["lr"]))
                group["lr"] = group["lr"] * factor
        if keep:
            lrs = []  # (a loop, not a comprehension: no function made at every window's end)
            for group in optimizer.param_groups:
                lr = group["lr"]
                lrs.append(lr.detach().clone() if isinstance(lr, Tensor) else lr)
            self.used_lrs.append((optimizer, lrs))

    def restore_lr(self) -> None:
        """Put back the learning rates ``scale_lr`` changed."""
        for group, lr in self._scaled_lrs:
            group["lr"] = lr
        self._scaled_lrs = []

    # ------------------------------------------------------------------ checkpoints
    def local_numbers(self) -> list[float]:
        """This rank's own part of the open window: its counts, the noise probe's prefixes so far and
        its losses (under DDP each rank's differ until the window's end; Lightning saves one rank's
        callback state). As many as ``number_count()``."""
        window = self.window
        assert window is not None
        chain = [0.0] * 4 if self.probe is None else self.probe.numbers()
        sums = self.metrics.sums()
        return [window.microbatches, window.samples, window.local_items(), *chain, *(float(v) for v in sums)]

    def number_count(self) -> int:
        """How many numbers ``local_numbers`` gives."""
        return 7 + len(self.metrics.names())

    def load_local_numbers(self, values: Sequence[float]) -> None:
        """Put back what `local_numbers` gave on this rank."""
        assert self.window is not None
        self.window.set_counts(*(int(v) for v in values[:3]))
        if self.probe is not None:
            self.probe.load_numbers(values[3:7])
        self.metrics.load_sums(self.metrics.names(), values[7:])

    def holds_partial_window(self) -> bool:
        """Whether a checkpoint now holds an open, not yet stepped window (warns if the strategy
        keeps its partial gradient where a checkpoint cannot reach it, and leaves it out)."""
        if self.window is None or self.closing is not None:
            return False
        return not sync.partial_window_lost(self.plan, self.window)

    def state_dict(self) -> dict[str, Any]:
        """Progress, the first window's ``k`` and the open window (if a checkpoint can hold it)."""
        window = self.window.state_dict() if self.window is not None and self.holds_partial_window() else None
        state: dict[str, Any] = {
            "progress": dataclasses.asdict(self.progress),
            "window": window,
            "first_k": self.first_k,
            "first_units": self.first_units,
            "schedule": self.schedule.state_dict(),
        }
        if self.lr_scaling == "adascale":
            state["adascale"] = self.adascale.state_dict()
        if callable(getattr(self.lr_schedule, "state_dict", None)):
            state["lr_schedule"] = self.lr_schedule.state_dict()  # type: ignore[union-attr]
        if window is not None:
            state.update(self._open_window_state())
        return state

    def _open_window_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside an open window: what its partial gradient is a sum of (a resume must sum the
        same), a budget's unit, the noise probe's prefixes, a batch to add nothing when trained again, its BatchNorm
        statistics and its losses."""
        state: dict[str, Any] = {"window_options": self._window_options()}
        if self.budgeted:  # (what its count `seen` is a count of)
            state["budget_unit"] = self.schedule.unit
        if self.probe is not None:
            state["probe"] = self.probe.state_dict()
        if self.redo is not None:
            state["redo"] = list(self.redo)
        if self.batchnorm is not None:
            state["batchnorm"] = self.batchnorm.state_dict()
        if self.metrics.tracking:
            state["losses"] = dict(zip(self.metrics.names(), (float(v) for v in self.metrics.sums()), strict=True))
        return state

    def _window_options(self) -> dict[str, str | None]:
        options = {"normalize": self.normalize, "reduction": self.reduction if self.normalize == "items" else None}
        if self.grad_accum_dtype is not None:  # (checkpoints without it: summed in the parameters' dtype)
            options["grad_accum_dtype"] = dtype_name(self.grad_accum_dtype)
        return options

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._load(state)

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state whose open window this engine cannot go on with (another ``grad_accum_dtype``, ``normalize``
        or ``reduction``, or kind of schedule); changes nothing, so that an adapter can check before it changes
        anything of its own."""
        saved, here = state.get("window_options"), self._window_options()
        if state.get("window") is not None and saved is not None:
            _check_same_dtype(saved.get("grad_accum_dtype"), here.get("grad_accum_dtype"))
        if state.get("window") is not None and saved not in (None, here):  # (checkpoints before it: not known)
            raise ValueError(
                "The checkpoint was written inside an accumulation window whose partial gradient was summed under "
                f"normalize={saved['normalize']!r}, reduction={saved['reduction']!r}; this run has "
                f"normalize={here['normalize']!r}, reduction={here['reduction']!r}, under which that gradient "
                "would be normalised as it was not summed. Resume with the checkpoint's `normalize` and "
                "`reduction` (and change them from a checkpoint written at an optimizer step), or resume from a "
                "checkpoint written at an optimizer step."
            )
        held = state.get("window")
        if held is not None and (held.get("budget") is not None) != self.budgeted:
            kinds = ("a `Budget`", "a schedule of k") if held.get("budget") is not None else (
                "a schedule of k", "a `Budget`"
            )  # fmt: skip
            raise ValueError(
                f"The checkpoint was written inside an accumulation window closed by {kinds[0]}; this run's schedule "
                f"{self.schedule!r} is {kinds[1]}, which cannot close that window as it was opened. Resume with the "
                "checkpoint's kind of schedule (and change it from a checkpoint written at an optimizer step), or "
                "resume from a checkpoint written at an optimizer step."
            )
        unit = state.get("budget_unit")  # (checkpoints before it: not known)
        if held is not None and self.budgeted and unit not in (None, self.schedule.unit):  # type: ignore[attr-defined]
            raise ValueError(
                f"The checkpoint was written inside an accumulation window closed by a `Budget` in {unit}; this run's "
                f"schedule {self.schedule!r} counts {self.schedule.unit}, which cannot close that window as it was "
                f"opened (its {held.get('seen')} {unit} so far would be added to {self.schedule.unit}). Resume with "
                f"`unit={unit!r}` in the `Budget` (and change the unit from a checkpoint written at an optimizer "
                "step), or resume from a checkpoint written at an optimizer step."
            )

    def _load(self, state: dict[str, Any]) -> None:
        if self.wide is not None:  # (the open window is the state's: sums a failed fit left are no part of it)
            self.wide.clear(self._scope)
        self.progress = Progress(**state["progress"])
        if "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
        if "lr_schedule" in state:
            self._load_lr_schedule(state["lr_schedule"])
        window = state.get("window")
        self.window = None if window is None else Window.from_state_dict(window)
        # (a base of 0 items, which checkpoints before 0.2 could hold after an empty first window: the next stepped
        # window's instead)
        self.first_k, self.first_units = state.get("first_k"), state.get("first_units") or None
        if "adascale" in state:
            self.adascale.load_state_dict(state["adascale"])
        self.closing, self.inflight, self._lr_multiplier = None, None, None
        redo = state.get("redo")
        self.redo = None if redo is None else (int(redo[0]), int(redo[1]))
        if self.probe is not None:
            self.probe.load_state_dict(state.get("probe", {}))
        losses = state.get("losses", {})
        self.metrics.load_sums(list(losses), list(losses.values()))
        self._load_batchnorm(state)

    def _load_lr_schedule(self, state: Any) -> None:
        """The ``lr_schedule``'s state a checkpoint held, into this run's (a warning if it cannot take it)."""
        if callable(getattr(self.lr_schedule, "load_state_dict", None)):
            self.lr_schedule.load_state_dict(state)  # type: ignore[union-attr]
        else:  # (the run goes on without the checkpoint's multiplier: the user left it out, or swapped it)
            warnings.warn(
                "The checkpoint holds the state of an `lr_schedule`, but this run's `lr_schedule` "
                f"({self.lr_schedule!r}) has no `load_state_dict` to take it: the run goes on without it. Pass "
                "the checkpoint's `lr_schedule` again to continue its multiplier.",
                stacklevel=4,
            )

    def _load_batchnorm(self, state: dict[str, Any]) -> None:
        """The open window's BatchNorm statistics (``batchnorm="window"``), and a warning where the checkpoint's
        window and this run pool them differently."""
        if self.batchnorm is not None:
            self.batchnorm.load_state_dict(state.get("batchnorm", {}) if self.window is not None else {})
        held = "batchnorm" in state
        if self.window is not None and self.window.microbatches and held != (self.batchnorm is not None):
            saved, now = ("'window'", "'micro-batch'") if held else ("'micro-batch'", "'window'")
            warnings.warn(
                f"The checkpoint was written inside an accumulation window under batchnorm={saved}; this run has "
                f"batchnorm={now}, so the BatchNorm statistics of the window's micro-batches before the checkpoint "
                + ("are dropped." if held else "are not in the window's (its buffers were updated by each of them).")
                + f" Resume with batchnorm={saved}, or from a checkpoint written at an optimizer step.",
                stacklevel=4,
            )


def _check_same_dtype(saved: str | None, here: str | None) -> None:
    """Refuse to resume a window a checkpoint holds part of under another ``grad_accum_dtype``: its partial gradient
    was summed (and its losses divided, or not) as that dtype says."""
    if saved == here:
        return
    summed = f"in {saved}" if saved else "in the parameters' dtype"
    raise ValueError(
        f"The checkpoint was written inside an accumulation window whose partial gradient was summed {summed} "
        f"(`grad_accum_dtype={saved!r}`); this run has `grad_accum_dtype={here!r}`, which would sum the rest of the "
        f"window differently. Resume with `grad_accum_dtype={saved!r}` (and change it from a checkpoint written at an "
        "optimizer step), or resume from a checkpoint written at an optimizer step."
    )
