"""The arguments the callback and the mixin share, checked in one place, and the mixin's config."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal

from torch import Tensor

from lightning_accum._core.batchnorm import check_batchnorm
from lightning_accum._core.decay import ResidualDecay
from lightning_accum._core.sync import SyncMode, check_sync_mode
from lightning_accum._core.wide import check_grad_accum_dtype
from lightning_accum._core.window import NORMALIZE
from lightning_accum.lr import LRMultiplier, LRSchedule, check_multiplier
from lightning_accum.schedules import Budget, Constant, Piecewise, Progress, Ramp, Schedule, as_schedule

LRScaling = Literal["linear", "sqrt", "adascale"]
"""How the learning rate follows k: ``"linear"`` (k / first k), ``"sqrt"``, or ``"adascale"`` (AdaScale's
gain from the measured gradient noise)."""
Reset = Literal["zero", "none"] | ResidualDecay  # (a `GradientDecay`)
"""What the mixin does to the gradients after each step: ``"zero"`` them (keeping the buffers), set them
to ``None`` (``"none"``), or decay them with a ``GradientDecay``."""
Count = Callable[[Any], int | Tensor]
"""``count(batch)``: a micro-batch's number of items (tokens, ...), an ``int`` or a one-element tensor
(read once per window); see ``lightning_accum.count``."""


def check_mode(step_schedulers: object) -> bool | None:
    """``step_schedulers`` as given (``None``, ``True`` or ``False``), or a ``TypeError`` naming it."""
    if step_schedulers is not None and not isinstance(step_schedulers, bool):
        raise TypeError(
            "`step_schedulers` must be True (the mixin steps the LR schedulers at each window's end), False (the "
            f"model steps them itself, as in Lightning's manual optimization) or None; got {step_schedulers!r}."
        )
    return step_schedulers


def check_common(
    who: str,
    schedule: Schedule | int | Mapping[int, int],
    normalize: object,
    count: object,
    lr_scaling: object,
    sync: object,
    lr_schedule: object = None,
) -> Schedule:
    """Refuse a bad ``normalize``, ``count``, ``lr_scaling`` or ``sync`` (and a schedule that
    counts items without ``count``) with a message naming the argument; returns the schedule."""
    resolved = as_schedule(schedule)
    if normalize not in NORMALIZE:
        raise ValueError(f"`normalize` must be 'mean' or 'items'; got {normalize!r}.")
    if count is not None and not callable(count):
        raise TypeError(f"`count` must be a function count(batch) -> int; got {count!r}.")
    if lr_scaling not in (None, "linear", "sqrt", "adascale"):
        raise ValueError(f"`lr_scaling` must be None, 'linear', 'sqrt' or 'adascale'; got {lr_scaling!r}.")
    if lr_schedule is not None and (not callable(lr_schedule) or isinstance(lr_schedule, type)):
        made = f" an instance, `{lr_schedule.__name__}(...)`, not the class" if isinstance(lr_schedule, type) else ""
        raise TypeError(
            f"`lr_schedule` must be a function of Progress giving a learning-rate multiplier, e.g. "
            f"`lightning_accum.lr.WarmupCosine(...)`{made}; got {lr_schedule!r}."
        )
    if lr_scaling == "adascale" and _always_one(resolved):
        raise ValueError(
            f"`lr_scaling='adascale'` measures the gradient noise inside windows of k >= 2, but {resolved!r} gives "
            "k = 1 throughout, so its gain would stay 1: use a schedule with k >= 2, or drop `lr_scaling`."
        )
    if lr_scaling == "adascale" and isinstance(resolved, Budget):
        raise ValueError(
            f"`lr_scaling='adascale'` measures the gradient noise at fixed micro-batch counts of windows whose size "
            f"is known when they open, which {resolved!r} does not give (its windows close on their count): use "
            "`lr_scaling='linear'` or `'sqrt'` (relative to the first window's budget), or a schedule of k."
        )
    if lr_schedule is not None and not _stateful(lr_schedule):  # fails now, not at the first step
        check_multiplier(lr_schedule(Progress()), lr_schedule, Progress())
    check_sync_mode(sync)
    inner = [("budget's n", resolved.n)] if isinstance(resolved, Budget) else []
    for what, counted in (("schedule", resolved), ("lr_schedule", lr_schedule), *inner):
        if getattr(counted, "unit", None) == "items" and count is None:
            raise ValueError(
                f"The {what} {counted!r} counts items, so `count` is needed: `{who}` needs `count`, a function "
                "giving each micro-batch's number of items (count(batch) -> int)."
            )
    return resolved


def _stateful(fn: object) -> bool:
    """Whether calling ``fn`` may change state that checkpoints keep (it has a ``state_dict`` of its own)."""
    method = getattr(type(fn), "state_dict", None)
    return method is not None and method is not LRSchedule.state_dict


def _always_one(schedule: Schedule) -> bool:
    """Whether ``schedule`` is known to give k = 1 for every window."""
    if isinstance(schedule, Constant):
        return schedule.k(Progress()) == 1
    if isinstance(schedule, Piecewise):
        return max(schedule.milestones.values()) == 1
    if isinstance(schedule, Ramp):
        return max(schedule.start, schedule.end) == 1
    return False


def check_flag(name: str, value: object) -> bool:
    """A ``bool`` argument, or a ``TypeError`` naming it (``log="yes"`` is not a yes)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False; got {value!r}.")
    return value


MicrobatchSize = int | Literal["auto"]
"""``microbatch_size=`` of ``AccumulationScheduler``: the most samples a piece of a loader batch holds, or
``"auto"`` (the loader batch, halved on out-of-memory)."""


def check_microbatch_size(value: object) -> MicrobatchSize | None:
    """``microbatch_size``: ``None``, an int >= 1 or ``"auto"``, or an error naming it and the fix."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value  # type: ignore[return-value]
    fix = "give None (no split), a number of samples >= 1 (e.g. 8), or 'auto' (halved on out-of-memory)"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"`microbatch_size` must be at least 1 sample; got {value!r}: {fix}.")
        return int(value)
    if isinstance(value, str):
        hint = " (lower case: 'auto')" if value.strip().lower() == "auto" else ""
        raise ValueError(f"`microbatch_size` got the string {value!r}{hint}; {fix}.")
    what = "a bool" if isinstance(value, bool) else f"a {type(value).__name__}"
    raise TypeError(f"`microbatch_size` must be a whole number of samples; got {value!r} ({what}): {fix}.")


Reduction = Literal["sum", "mean"]
"""What ``training_step`` returns over a micro-batch's items with ``normalize="items"``: their ``"sum"``, or
their ``"mean"`` (weighted by ``count(batch)``)."""


# near misses of a reduction, and what they meant
_NEAR_REDUCTIONS = dict(avg="mean", average="mean", means="mean", token_mean="mean", sums="sum", total="sum")


def check_reduction(reduction: object) -> Reduction | None:
    """``reduction``: ``None``, ``"sum"`` or ``"mean"``, or an error naming it and the fix (a near miss hinted)."""
    if reduction is None or (isinstance(reduction, str) and reduction in ("sum", "mean")):
        return reduction  # type: ignore[return-value]
    fix = (
        "give 'mean' for a mean over the micro-batch's items (a Hugging Face `outputs.loss`, `F.cross_entropy(...)`), "
        "which is weighted by `count(batch)`, or 'sum' for a sum over them"
    )
    if not isinstance(reduction, str):
        what = "a bool" if isinstance(reduction, bool) else f"a {type(reduction).__name__}"
        raise TypeError(
            f"`reduction` must be the string 'sum' or 'mean' (the loss over a micro-batch's items); got {reduction!r} "
            f"({what}): {fix}."
        )
    word = reduction.strip().lower()
    if word in ("sum", "mean"):
        hint = f" (lower case, no spaces: {word!r})"
    elif word in _NEAR_REDUCTIONS:
        hint = f" (did you mean {_NEAR_REDUCTIONS[word]!r}?)"
    elif word == "none":
        hint = " (a loss per item, `reduction='none'` in torch, is not taken: reduce it to its sum or mean first)"
    else:
        hint = ""
    raise ValueError(
        f"`reduction` must be 'sum' or 'mean' (the loss over a micro-batch's items); got {reduction!r}{hint}: {fix}."
    )


def check_callback_items(
    normalize: object, count: object, reduction: object, loss: str = "`training_step` returns"
) -> Reduction:
    """The callback's ``normalize="items"`` needs ``count`` and an explicit ``reduction`` (whether
    ``training_step`` returns a sum or a mean over the micro-batch's items: a mean taken for a sum
    would be divided by the item count twice, silently). Returns the reduction in force. ``loss``: what
    the adapter's loss is, for the messages."""
    reduction = check_reduction(reduction)
    if normalize == "items" and count is None:
        raise ValueError(
            "`normalize='items'` needs `count`: a function giving each micro-batch's number of items, "
            "e.g. `count=lambda batch: int(batch['mask'].sum())` or `lightning_accum.count.causal_lm_tokens`."
        )
    _check_reduction_given(normalize, reduction, loss)
    return "mean" if reduction == "mean" else "sum"


def check_mixin_items(normalize: object, count: object, reduction: object) -> Reduction:
    """``configure_accumulation``'s ``reduction``, as the callback's, but for the mixin's passes that declare their
    own items: ``normalize="items"`` without ``count`` (each pass then gives ``acc.backward(loss, items=n)``) takes
    no ``reduction``, since it reads ``count(batch)``. Returns the reduction in force (``"sum"`` without ``count``)."""
    reduction = check_reduction(reduction)
    if normalize == "items" and count is None and reduction is not None:
        raise ValueError(
            f"`reduction={reduction!r}` says what `acc.backward(loss)` is over the micro-batch's items, as "
            "`count(batch)` counts them, but no `count` was given: give `count=` (e.g. "
            "`lightning_accum.count.causal_lm_tokens`), or leave `reduction` out and give each pass its items, "
            "`acc.backward(mean_loss, items=n)`."
        )
    if count is not None or reduction is not None:
        _check_reduction_given(normalize, reduction, "`acc.backward(loss)` gets")
    return "mean" if reduction == "mean" else "sum"


def _check_reduction_given(normalize: object, reduction: Reduction | None, loss: str) -> None:
    """``reduction`` given exactly where ``normalize="items"`` reads it."""
    if normalize == "items" and reduction is None:
        raise ValueError(
            f"`normalize='items'` needs `reduction`: what {loss} over a micro-batch's items. "
            "Give `reduction='mean'` for a mean (a Hugging Face `outputs.loss`, `F.cross_entropy(...)`), which is "
            "weighted by `count(batch)`, or `reduction='sum'` for a sum (`reduction='sum'` in the loss)."
        )
    if reduction is not None and normalize != "items":
        raise ValueError(
            f"`reduction={reduction!r}` says what the loss is over a micro-batch's items, which only "
            "`normalize='items'` (with `count`) uses; with `normalize='mean'` each micro-batch counts once, whatever "
            "its loss: leave `reduction` out, or give `normalize='items'`."
        )


def check_clip(value: object, algorithm: object) -> None:
    """``gradient_clip_val`` (``None``, or a finite number > 0) and ``gradient_clip_algorithm`` (``"norm"`` or
    ``"value"``), or an error naming the argument: 0 would zero every gradient (the Trainer's and Hugging Face's
    "no clipping" is ``None`` here), a negative one would step uphill, NaN would make every parameter NaN."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
    ):
        raise ValueError(
            f"`gradient_clip_val` must be a finite number > 0, or None for no clipping; got {value!r}"
            + (" (0 would zero every gradient: give None to turn clipping off)." if value == 0 else ".")
        )
    if algorithm not in ("norm", "value"):
        raise ValueError(f"`gradient_clip_algorithm` must be 'norm' or 'value'; got {algorithm!r}.")
    if algorithm == "value" and value is None:
        raise ValueError(
            "`gradient_clip_algorithm='value'` was given without `gradient_clip_val`, so nothing would be clipped: "
            "give `gradient_clip_val` too, or leave both out."
        )


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    """What ``AccumulationMixin.configure_accumulation`` was given, validated."""

    schedule: Schedule
    normalize: str = "mean"
    count: Count | None = None
    reset: Reset = "zero"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    lr_scaling: str | None = None
    log: bool = True
    sync: SyncMode = "auto"
    lr_schedule: LRMultiplier | None = None
    step_schedulers: bool | None = None
    reduction: Reduction | None = None
    batchnorm: str = "micro-batch"
    grad_accum_dtype: Any = None  # (a dtype once checked: a name is resolved in `__post_init__`)
    read_ahead: bool = False  # a `Budget`'s counts read ahead from the training loader (one block per step)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_accum_dtype", check_grad_accum_dtype(self.grad_accum_dtype))
        args = (self.schedule, self.normalize, self.count, self.lr_scaling, self.sync, self.lr_schedule)
        check_common("configure_accumulation", *args)
        check_mixin_items(self.normalize, self.count, self.reduction)
        check_flag("log", self.log)
        check_flag("read_ahead", self.read_ahead)
        check_mode(self.step_schedulers)
        check_batchnorm(self.batchnorm)
        reset = self.reset
        if not (isinstance(reset, ResidualDecay) or reset in ("zero", "none")):
            raise ValueError(f"`reset` must be 'zero', 'none' or a `GradientDecay`; got {reset!r}.")
        check_clip(self.gradient_clip_val, self.gradient_clip_algorithm)

    @property
    def mean_items(self) -> bool:
        """Whether ``acc.backward(loss)`` gets a mean over the micro-batch's items (``reduction="mean"``), weighted
        by ``count(batch)``."""
        return self.normalize == "items" and self.reduction == "mean"

    @property
    def decay(self) -> ResidualDecay | None:
        """The reset policy when it is a ``GradientDecay``."""
        return self.reset if isinstance(self.reset, ResidualDecay) else None
