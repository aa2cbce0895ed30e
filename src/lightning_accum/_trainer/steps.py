"""``estimated_stepping_batches``: the optimizer steps a whole fit takes under the accumulation schedule.

Lightning's ``trainer.estimated_stepping_batches`` divides the batches by
``accumulate_grad_batches``, which is 1 when the package accumulates: a warm-up or decay sized
with it (OneCycle, cosine, ``get_linear_schedule_with_warmup``) would be stretched by the mean k.
This walks the fit's windows as the package will form them instead.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from lightning_accum import _seam
from lightning_accum._lightning import PossibleUserWarning, rank_zero_warn
from lightning_accum.noise import NoiseScale
from lightning_accum.schedules import Budget, Constant, Progress, Schedule


def estimated_stepping_batches(trainer: Any, *, optimizers: int = 1) -> int | float:
    """The number of optimizer steps the whole fit will take under the active
    ``AccumulationScheduler`` or ``AccumulationMixin`` schedule (Lightning's own estimate without
    one). Call it in ``configure_optimizers`` instead of ``trainer.estimated_stepping_batches``.

    ``optimizers``: how many optimizers step at each window (the mixin's window shared by several, or windows
    of their own closing at the same batches). Each one's steps count in ``trainer.global_step``, so
    ``max_steps`` ends the fit after ``ceil(max_steps / optimizers)`` windows: the count returned is each
    optimizer's, the horizon of a scheduler on one of them. The optimizers do not exist yet in
    ``configure_optimizers``, hence the argument. Windows of one optimizer fed only some batches (a GAN
    alternating its optimizers) take fewer steps than the walk of every batch gives: not known in advance.

    Honours ``max_epochs``, ``max_steps``, ``limit_train_batches``, windows cut short at epoch
    ends and several devices. Exact for schedules keyed on epochs or steps, and on samples when
    the training loader has a length and a batch size (the last batch of an epoch may be
    smaller; every rank is taken to get as many samples). Schedules keyed on items, and
    ``NoiseScale``, depend on data or measurements not known in advance: refused, pointing to
    ``lr_schedule`` keyed on items. An endless fit (``max_epochs=-1`` without ``max_steps``)
    gives ``math.inf``, as Lightning's property does; a fit that trains nothing (``max_steps=0``,
    ``limit_train_batches=0``) gives 0. Called before the fit (no model attached to the Trainer), it
    is refused. Safe in a fit resumed inside an epoch: the training loader is set up again after the
    checkpoint is restored, so the resumed epoch continues where it stopped (with or without an
    accumulation schedule; Lightning's own property starts the epoch over).

    Example:

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            steps = lightning_accum.estimated_stepping_batches(self.trainer)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=steps)
            return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
    """
    n = _check_optimizers(optimizers)
    return _per_optimizer(_estimate(trainer), trainer.max_steps, n)


def _check_optimizers(optimizers: object) -> int:
    what = (
        "`estimated_stepping_batches(trainer, optimizers=...)` takes how many optimizers step at each window, an "
        f"integer >= 1 (e.g. `optimizers=2` for the mixin's window shared by two); got {optimizers!r}."
    )
    if isinstance(optimizers, bool) or not isinstance(optimizers, numbers.Integral):
        raise TypeError(what)
    if optimizers < 1:
        raise ValueError(what)
    return int(optimizers)


def _per_optimizer(steps: int | float, max_steps: int, optimizers: int) -> int | float:
    """``steps`` when ``max_steps`` counts each of ``optimizers``' steps (``trainer.global_step`` in manual
    optimization): ``ceil(max_steps / optimizers)`` windows at most."""
    if optimizers == 1 or max_steps < 0:
        return steps
    return min(steps, -(-max_steps // optimizers))


def _estimate(trainer: Any) -> int | float:
    """``estimated_stepping_batches`` for one optimizer."""
    if getattr(trainer, "lightning_module", None) is None:
        raise RuntimeError(
            "`estimated_stepping_batches(trainer)` was called before a fit: it counts the steps of the fit's "
            "training loader under its schedule, which exist once `trainer.fit(model, ...)` runs. Call it inside "
            "the fit, in `configure_optimizers` (`lightning_accum.estimated_stepping_batches(self.trainer)`)."
        )
    if trainer.max_steps == 0 or trainer.limit_train_batches == 0:
        return 0  # (a fit that trains nothing: Lightning skips training; its own property gives -1 here)
    found = _active_schedule(trainer)
    if found is None:  # Lightning's estimate, with the loader set up as below (Lightning's alone loses a
        release = _seam.set_up_training_loader(trainer)  # resumed epoch's loader state)
        try:
            steps = trainer.estimated_stepping_batches
        finally:
            release()
        return steps if math.isinf(steps) else int(steps)
    schedule, counted = found
    _refuse_unknown_steps(schedule)
    if trainer.max_epochs == -1 and trainer.max_steps == -1:
        return math.inf  # an endless fit (as Lightning's property)
    release = _seam.set_up_training_loader(trainer)
    try:
        batches = trainer.num_training_batches
        if math.isinf(batches):
            return _steps_of_endless_loader(trainer)
        needed = schedule.unit in ("samples", None) and not isinstance(schedule, Constant)
        sizes = _samples_per_batch(trainer, int(batches), needed=needed)
    finally:
        release()
    return _walk_known(trainer, schedule, int(batches), sizes, counted)


def _refuse_unknown_steps(schedule: Schedule) -> None:
    """Refuse a schedule whose optimizer steps depend on what the data or the gradient will hold: a ``Budget`` of
    items (or whose ``n`` follows them), a schedule keyed on items, on ``scaled_steps``, or a ``NoiseScale``."""
    if isinstance(schedule, Budget) and "items" in (schedule.unit, schedule.n.unit):
        whose = "" if schedule.unit == "items" else " (its `n` follows them)"
        raise ValueError(
            f"The number of optimizer steps under {schedule!r} depends on the items (tokens) each batch will "
            f"hold{whose}, so it cannot be known in advance. Key the learning rate on what is seen instead: "
            "`lr_schedule=lightning_accum.lr.WarmupCosine(warmup, total, unit='items')`, or use "
            "`Budget(n, unit='samples')` with `n` a number or keyed on samples or steps, whose steps a loader of fixed "
            "batch size gives exactly."
        )
    if isinstance(schedule, NoiseScale) or schedule.unit in ("items", "scaled_steps"):
        measured = isinstance(schedule, NoiseScale) or schedule.unit == "scaled_steps"
        what = "the measured gradient noise" if measured else "the items (tokens) the data will hold"
        raise ValueError(
            f"The number of optimizer steps under {schedule!r} depends on {what}, so it cannot be known in advance. "
            "Key the learning rate on what is seen instead: "
            "`lr_schedule=lightning_accum.lr.WarmupCosine(warmup, total, unit='items')`."
        )


def _steps_of_endless_loader(trainer: Any) -> int:
    """A training loader without a length: ``max_steps`` bounds the fit, or its steps cannot be counted."""
    if trainer.max_steps != -1:
        return int(trainer.max_steps)
    raise ValueError(
        "The training loader has no length (an iterable dataset), so the steps of an epoch cannot be "
        "counted in advance: give the Trainer `max_steps`, or an integer `limit_train_batches` to bound "
        "each epoch."
    )


def _walk_known(trainer: Any, schedule: Schedule, batches: int, sizes: list[int] | None, counted: bool) -> int:
    """``_walk`` of the fit, refused where the schedule reads the items a ``count`` gives (with a ``count`` the items
    are not the samples: a function that reads them cannot be walked)."""
    try:
        return _walk(schedule, batches, sizes, trainer.max_epochs, trainer.max_steps, items_known=not counted)
    except ItemsNotKnown:
        raise ValueError(
            f"The number of optimizer steps under {schedule!r} depends on the items (tokens) each batch will hold: "
            "its function reads `Progress.items`, which `count` gives as the fit goes, so it cannot be known in "
            "advance. Key the learning rate on what is seen instead: "
            "`lr_schedule=lightning_accum.lr.WarmupCosine(warmup, total, unit='items')`, or key the function on "
            "`Progress.samples` or `Progress.step`, whose steps a loader of fixed batch size gives exactly."
        ) from None


def _active_schedule(trainer: Any) -> tuple[Schedule, bool] | None:
    """The schedule of the Trainer's ``AccumulationScheduler`` or of the module's mixin, and
    whether a ``count`` is given."""
    found = accumulating(trainer)
    return None if found is None else (found.schedule, found.counted)


@dataclass(frozen=True)
class Accumulating:
    """What a fit accumulates under, read from its ``AccumulationScheduler`` or its module's mixin: the
    schedule, whether a ``count`` is given, ``normalize``, and where its ``Progress`` is read."""

    schedule: Schedule
    counted: bool
    normalize: str
    progress: Callable[[], Progress]


def accumulating(trainer: Any) -> Accumulating | None:
    """The fit's accumulation (``None`` without an ``AccumulationScheduler`` or an ``AccumulationMixin``)."""
    for callback in trainer.callbacks:  # an `AccumulationScheduler` (which imports this module)
        if isinstance(getattr(callback, "schedule", None), Schedule) and hasattr(callback, "count"):
            return Accumulating(callback.schedule, callback.count is not None, callback.normalize, _reader(callback))
    module = getattr(trainer, "lightning_module", None)
    driver = getattr(module, "_accumulation", None)
    if driver is None:
        return None
    config = driver.config
    return Accumulating(config.schedule, config.count is not None, config.normalize, _reader(module, mixin=True))


def _reader(owner: Any, mixin: bool = False) -> Callable[[], Progress]:
    """Where ``owner``'s ``Progress`` is read: the callback's ``progress``, the mixin's ``accumulation_progress``."""

    def read() -> Progress:
        progress: Progress = owner.accumulation_progress if mixin else owner.progress
        return progress

    return read


def _samples_per_batch(trainer: Any, batches: int, needed: bool) -> list[int] | None:
    """Samples of each batch of an epoch over all ranks, from the loader's batch sampler."""
    loader = trainer.train_dataloader
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None)
    inner = getattr(sampler, "sampler", None)
    if size is None or inner is None or not hasattr(inner, "__len__"):
        if needed:
            raise ValueError(
                "The schedule counts samples, but the training loader does not say how many each batch holds (a "
                "`DataLoader` with a `batch_size` and a sampler with a length does). Key the schedule on 'step' or "
                "'epoch', or the learning rate on samples with `lr_schedule`."
            )
        return None
    n = len(inner)
    sizes = [size] * (n // size) + ([n % size] if n % size and not getattr(sampler, "drop_last", False) else [])
    world = int(trainer.world_size)
    return [s * world for s in sizes[:batches]]


def _walk(
    schedule: Schedule, batches: int, sizes: list[int] | None, max_epochs: int, max_steps: int, items_known: bool = True
) -> int:
    """Form the fit's windows as the package will: the schedule asked at each window's start,
    windows cut short at each epoch's end; stop at ``max_steps``."""
    found = _walk_within(schedule, batches, sizes, max_epochs, max_steps, math.inf, items_known)
    assert found is not None  # (no budget)
    return found


def _walk_within(
    schedule: Schedule,
    batches: int,
    sizes: list[int] | None,
    max_epochs: int,
    max_steps: int,
    budget: float,
    items_known: bool = True,
) -> int | None:
    """``_walk``, or ``None`` once it has formed ``budget`` windows without reaching the fit's end."""
    progress = Progress()
    epoch = 0
    while max_epochs == -1 or epoch < max(max_epochs, 1):
        progress = dataclasses.replace(progress, epoch=epoch)
        for _, after in windows(schedule, progress, 0, batches, sizes, items_known):
            progress = after
            if progress.step == max_steps:
                return progress.step
            if progress.step >= budget:
                return None
        epoch += 1
    return progress.step


class ItemsNotKnown(Exception):
    """A schedule read ``Progress.items`` in a walk that does not know them (a ``count`` gives them as the fit goes)."""


class _ItemsUnknown(Progress):
    """The ``Progress`` a walk asks a schedule with where the items are not known: reading ``items`` raises
    ``ItemsNotKnown`` (so that a function of ``Progress`` that reads them is not walked on a guess)."""

    @override
    def __getattribute__(self, name: str) -> Any:
        if name == "items":
            raise ItemsNotKnown
        return super().__getattribute__(name)

    @override
    def __repr__(self) -> str:
        return f"Progress(epoch={self.epoch}, step={self.step}, samples={self.samples}, items=?, ...)"


def windows(
    schedule: Schedule,
    progress: Progress,
    start: int,
    batches: int | float,
    sizes: Sequence[int] | None,
    items_known: bool = True,
) -> Iterator[tuple[int, Progress]]:
    """The windows the package forms from the epoch's batch ``start`` to its end (``batches``; endless for an
    iterable loader's ``inf``), ``progress`` being where the first opens: each as its micro-batches and the
    ``Progress`` after it. ``sizes``: each batch's samples over all ranks (``None``: unknown, samples not
    counted). The items grow as the samples do, which they do without a ``count``; ``items_known=False`` (with
    one): a schedule that reads them raises ``ItemsNotKnown``. The schedule is asked as the engine asks it."""
    step, samples, microbatches = progress.step, progress.samples, progress.microbatches
    extra = progress.items - progress.samples
    asking = Progress if items_known else _ItemsUnknown
    while start < batches:
        asked = asking(progress.epoch, step, samples, samples + extra, microbatches, progress.scaled_steps)
        k = schedule(asked)
        if isinstance(schedule, Budget):  # (samples: the walk knows each batch's; it adds them as the engine does)
            m = _budget_window(schedule.budget(asked), k, start, batches, sizes)
        else:
            m = int(min(k, batches - start))
        samples += 0 if sizes is None else sum(sizes[start : start + m])
        microbatches += m
        step += 1
        start += m
        yield m, Progress(progress.epoch, step, samples, samples + extra, microbatches, progress.scaled_steps)


def _budget_window(budget: int, cap: int, start: int, batches: int | float, sizes: Sequence[int] | None) -> int:
    """The micro-batches of a ``Budget``'s window opening at batch ``start``: up to the first batch at which the
    samples over all ranks (``sizes``) reach ``budget``, at most ``cap``, or to the epoch's end."""
    if sizes is None:
        raise ValueError("A budget's windows can be walked only from each batch's samples (`sizes`).")
    m = seen = 0
    while start + m < batches and m < cap:
        seen += sizes[start + m]
        m += 1
        if seen >= budget:
            break
    return m


def windows_ahead(
    schedule: Schedule,
    progress: Progress,
    start: int,
    batches: int | float,
    sizes: Sequence[int] | None,
    limit: int | float,
    items_known: bool = True,
) -> tuple[int, int]:
    """How many windows the package will still close in this epoch from batch ``start`` (``progress`` where the
    next opens; at most ``limit`` of them, the steps ``max_steps`` leaves), and the batches they take:
    ``windows`` counted. Exact where the schedule keys on what the walk knows (epochs, steps, micro-batches,
    and samples with ``sizes``; the items where ``items_known``, else ``ItemsNotKnown`` if it reads them)."""
    count = taken = 0
    if limit <= 0:
        return 0, 0
    for m, _ in windows(schedule, progress, start, batches, sizes, items_known):
        count, taken = count + 1, taken + m
        if count >= limit:
            break
    return count, taken


def walk_is_exact(schedule: Schedule, sizes: Sequence[int] | None) -> bool:
    """Whether ``windows`` forms the windows the package will for ``schedule``: keyed on what the walk knows
    (``Constant``, epochs, steps, and samples where ``sizes`` gives each batch's). Not for items, ``Lambda`` (it may
    read anything), ``NoiseScale`` (measured), or samples of a loader that does not say its batch sizes."""
    if isinstance(schedule, NoiseScale) or (isinstance(schedule, Budget) and schedule.n.unit == "items"):
        return False  # (a budget whose `n` follows the items: the walk does not know them)
    unit = getattr(schedule, "unit", None)
    return isinstance(schedule, Constant) or unit in ("epoch", "step") or (unit == "samples" and bool(sizes))


#: the most windows ``fit_windows`` walks (about 3 us each on a CPU core: 0.6 s)
WALK_BUDGET = 200_000


def fit_windows(
    schedule: Schedule,
    batches: int,
    sizes: list[int] | None,
    max_epochs: int,
    max_steps: int,
    items_known: bool = True,
) -> int | None:
    """The windows a whole fit of ``max_epochs`` epochs of ``batches`` batches forms from its start, at most
    ``max_steps`` (-1: unbounded; not both unbounded): ``estimated_stepping_batches``'s walk, for a schedule
    ``walk_is_exact`` takes; ``None`` where that walk would pass ``WALK_BUDGET`` windows (``ItemsNotKnown`` where
    the schedule reads items it does not know). Counted without walking every window: ``Constant``
    (``ceil(batches / k)`` windows an epoch) and schedules keyed on epochs (the same, with each epoch's k)."""
    if max_steps == 0 or batches == 0:
        return 0
    if isinstance(schedule, Constant):
        if max_epochs == -1:
            return max_steps
        total = max(max_epochs, 1) * -(-batches // schedule(Progress()))
        return total if max_steps < 0 else min(total, max_steps)
    if getattr(schedule, "unit", None) == "epoch":  # (k the same through each epoch)
        total, epoch = 0, 0
        while (max_epochs == -1 or epoch < max(max_epochs, 1)) and (max_steps < 0 or total < max_steps):
            if epoch >= WALK_BUDGET:
                return None
            total += -(-batches // schedule(Progress(epoch=epoch, step=total)))
            epoch += 1
        return total if max_steps < 0 else min(total, max_steps)
    return _walk_within(schedule, batches, sizes, max_epochs, max_steps, WALK_BUDGET, items_known)


def samples_per_batch(trainer: Any, batches: int) -> list[int] | None:
    """Samples of each of an epoch's ``batches`` over all ranks, from the training loader's batch sampler
    (``None`` where it does not say)."""
    return _samples_per_batch(trainer, batches, needed=False)


class SchedulerHorizonWarning(PossibleUserWarning):
    """The warning at a fit's start about a step-interval LR scheduler whose length (``total_steps``, ``T_max``) is
    not the fit's number of optimizer steps under the accumulation schedule, or cannot be checked against it.

    Most such schedulers were sized with Lightning's ``trainer.estimated_stepping_batches``, which does not know the
    schedule. One sized so on purpose (a cosine meant to end before the fit, a ``OneCycleLR`` shared by several
    fits) silences it with a ``warnings`` filter on this category, which leaves every other warning as it is. It is
    a ``UserWarning``, and Lightning's ``PossibleUserWarning`` (a filter on that one silences it too).

    Example:

        >>> import warnings
        >>> from lightning_accum import SchedulerHorizonWarning
        >>> with warnings.catch_warnings():  # (or once, before `trainer.fit`)
        ...     warnings.filterwarnings("ignore", category=SchedulerHorizonWarning)  # the length is meant
        ...     warnings.warn("...", SchedulerHorizonWarning)  # (what the fit's start would warn: silenced)
        >>> issubclass(SchedulerHorizonWarning, UserWarning)
        True
    """


#: what each horizon warning ends with
_ON_PURPOSE = (
    " (Sized so on purpose: `warnings.filterwarnings('ignore', category=lightning_accum.SchedulerHorizonWarning)`.)"
)


def warn_scheduler_horizons(trainer: Any, optimizers: int = 1) -> None:
    """At a fit's start: warn about each step-interval LR scheduler whose horizon (``total_steps``, as
    ``OneCycleLR``'s, or ``T_max``, as ``CosineAnnealingLR``'s) is not the fit's real number of its steps
    (optimizer steps over the config's ``frequency``; ``optimizers`` step at each window): sized with
    ``trainer.estimated_stepping_batches`` it is stretched by the mean k. Nothing where the real count cannot
    be known in advance."""
    configs = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
    horizons = [
        (c, n, getattr(c.scheduler, n)) for c in configs for n in ("total_steps", "T_max") if hasattr(c.scheduler, n)
    ]
    if not horizons:
        return
    try:
        steps = estimated_stepping_batches(trainer, optimizers=optimizers)
    except ValueError as unknown:  # (a schedule keyed on items, `NoiseScale`, a loader without length)
        named = ", ".join(f"{type(c.scheduler).__name__} ({n}={int(h)})" for c, n, h in horizons)
        rank_zero_warn(
            f"The LR scheduler {named} is sized for a number of optimizer steps, but this fit's cannot be known at "
            "its start, so that length cannot be checked against the accumulation schedule (it may end before "
            f"the fit, or the fit before it). {unknown}{_ON_PURPOSE}",
            category=SchedulerHorizonWarning,
        )
        return
    if math.isinf(steps):
        return
    size_with = "" if optimizers == 1 else f", optimizers={optimizers}"  # (`max_steps` counts each one's step)
    for config, _, horizon in horizons:
        real = steps // config.frequency
        if int(horizon) != real:
            rank_zero_warn(
                f"The LR scheduler {type(config.scheduler).__name__} is sized for {int(horizon)} steps, but this fit "
                f"takes {real} (optimizer steps{f' / frequency {config.frequency}' if config.frequency > 1 else ''}) "
                "under the accumulation schedule; `trainer.estimated_stepping_batches` does not know the schedule. "
                f"Size it with `lightning_accum.estimated_stepping_batches(trainer{size_with})`.{_ON_PURPOSE}",
                category=SchedulerHorizonWarning,
            )
