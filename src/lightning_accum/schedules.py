"""Accumulation schedules: training progress in, micro-batches per window out.

A schedule is asked once per window, when the window opens, for ``k``: how many
micro-batches the window holds. It sees only ``Progress``, which is identical on
every rank (counts are summed over ranks), so every rank gets the same ``k``.

This module is plain Python: it imports neither torch nor Lightning.
"""

from __future__ import annotations

import bisect
import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from typing_extensions import override

Unit = Literal[
    "epoch", "step", "samples", "items", "scaled_steps",
    "epochs", "steps", "sample", "item", "scaled_step", "tokens", "token",
]  # fmt: skip
"""What a schedule is keyed on: ``"epoch"``, ``"step"`` (optimizer steps), ``"samples"``, ``"items"``
(tokens or other counted items; ``"tokens"`` is accepted as another name for them) or ``"scaled_steps"``
(AdaScale's progress), over all ranks; the other number of each is accepted too (``"steps"``, ``"sample"``)."""
UNITS: tuple[str, ...] = ("epoch", "step", "samples", "items", "scaled_steps")
_OTHER_NAME = {
    "epochs": "epoch",
    "steps": "step",
    "sample": "samples",
    "item": "items",
    "tokens": "items",  # (what most users count)
    "token": "items",
    "scaled_step": "scaled_steps",
}


@dataclass(frozen=True)
class Progress:
    """How far training has come when a window opens.

    Attributes:
        epoch: the current epoch (0-based).
        step: optimizer steps done (windows closed).
        samples: samples consumed by the closed windows, summed over all ranks.
        items: counted items (tokens, ...) in the closed windows, summed over all ranks; equals
            ``samples`` when no ``count`` function is given.
        microbatches: micro-batches consumed by the closed windows on one rank.
        scaled_steps: the sum of the closed windows' AdaScale gains (``lr_scaling="adascale"``):
            progress in steps of the first window's batch, so that a schedule written for that
            batch runs unchanged at any k; equals ``step`` without AdaScale.
    """

    epoch: int = 0
    step: int = 0
    samples: int = 0
    items: int = 0
    microbatches: int = 0
    scaled_steps: float = 0.0

    def value(self, unit: str) -> float:
        """The counter that ``unit`` names (``"epoch"``, ``"step"``, ``"samples"``, ``"items"`` or
        ``"scaled_steps"``)."""
        value: float = getattr(self, _check_unit(unit, UNITS))
        return value


def _check_unit(unit: object, allowed: tuple[str, ...]) -> str:
    """``unit`` as ``allowed`` spells it (singular or plural accepted), or an error with the near miss."""
    if isinstance(unit, str):
        unit = _OTHER_NAME.get(unit, unit)
    if unit not in allowed:
        spellings = [*allowed, *(name for name, meant in _OTHER_NAME.items() if meant in allowed)]
        near = difflib.get_close_matches(str(unit).lower(), spellings, n=1) if isinstance(unit, str) else []
        near = [_OTHER_NAME.get(near[0], near[0])] if near else []
        hint = f" Did you mean {near[0]!r}?" if near else ""
        tokens = " ('tokens' is another name for 'items'; singular or plural)" if "items" in allowed else ""
        raise ValueError(f"`unit` must be one of {', '.join(map(repr, allowed))}{tokens}; got {unit!r}.{hint}")
    return str(unit)


def _check_k(value: object, name: str, what: str = "micro-batches per window") -> int:
    """``value`` as an ``int >= 1``, or a ``ValueError`` naming ``name`` and ``what`` it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"`{name}` must be an int >= 1 ({what}); got {value!r}.")
    return int(value)


def _check_count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"`{name}` must be an int >= 0; got {value!r}.")
    return int(value)


class Schedule:
    """Base class: maps ``Progress`` to ``k >= 1``, the micro-batches of the next window.

    Subclasses implement ``k``; calling the schedule validates the result. Stateless
    schedules keep the default empty ``state_dict``; stateful ones (adaptive schedules)
    override it so that a resumed run continues exactly.

    Example:

        >>> class EveryOtherEpoch(Schedule):
        ...     def k(self, progress: Progress) -> int:
        ...         return 4 if progress.epoch % 2 else 2
        >>> EveryOtherEpoch()(Progress(epoch=1))
        4
    """

    #: the progress counter the schedule reads, if it reads just one (used for early checks)
    unit: str | None = None
    #: whether ``k`` depends on ``Progress`` (and state shared by all ranks) alone, so that every
    #: rank computes the same ``k``; if not (``Lambda``, subclasses), the ranks' ``k`` are compared
    #: at each window's start, which costs one small all-reduce per optimizer step
    rank_consistent: bool = False
    #: whether ``k`` is measured from the gradient of windows of a fixed ``k`` (``NoiseScale``): such a schedule
    #: cannot set a ``Budget``'s size
    measures_noise: bool = False

    def k(self, progress: Progress) -> int:
        """The window size for ``progress``: the method a schedule of your own defines (``__call__`` checks
        what it returns: an int >= 1, the same on every rank)."""
        raise NotImplementedError

    def __call__(self, progress: Progress) -> int:
        value = self.k(progress)
        if type(value) is int and value >= 1:  # the common case, without the slower ABC checks below
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
            raise ValueError(f"{self!r} returned k={value!r} at {progress}; a schedule must return an int >= 1.")
        return int(value)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the schedule (nothing for a stateless one; ``NoiseScale`` keeps its
        estimator)."""
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; stateless schedules have nothing to restore."""

    @override
    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    @override
    def __hash__(self) -> int:
        return hash(repr(self))


class Constant(Schedule):
    """The same ``k`` for every window.

    Example:

        >>> Constant(4)(Progress(step=1000))
        4
    """

    rank_consistent = True

    def __init__(self, k: int) -> None:
        self._k = _check_k(k, "k")

    @override
    def k(self, progress: Progress) -> int:
        """Always the same ``k``."""
        return self._k

    @override
    def __repr__(self) -> str:
        return f"Constant({self._k})"


class Piecewise(Schedule):
    """``k`` from the largest milestone reached; ``k = 1`` before the first milestone.

    ``milestones`` maps a value of ``unit`` (epoch, optimizer step, samples or items, all
    0-based counts of what is done) to ``k``; a sequence of ``(milestone, k)`` pairs works
    too. ``Piecewise({4: 2})`` behaves like Lightning's ``GradientAccumulationScheduler({4: 2})``,
    except that with ``unit="step"``, ``"samples"`` or ``"items"`` the change happens at the
    first window that opens past the milestone, mid-epoch included.

    Example:

        >>> s = Piecewise({0: 1, 1000: 4, 5000: 8}, unit="samples")
        >>> s(Progress(samples=999)), s(Progress(samples=1000)), s(Progress(samples=10**6))
        (1, 4, 8)
    """

    rank_consistent = True

    def __init__(self, milestones: Mapping[int, int] | Iterable[tuple[int, int]], unit: Unit = "epoch") -> None:
        self.unit = _check_unit(unit, UNITS)
        pairs = list(milestones.items()) if isinstance(milestones, Mapping) else list(milestones)
        if not pairs:
            raise ValueError("`milestones` is empty; give at least one `{milestone: k}` entry, e.g. `{0: 2}`.")
        table: dict[int, int] = {}
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"`milestones` entries must be `(milestone, k)` pairs; got {pair!r}.")
            at = _check_count(pair[0], f"milestones key ({unit})")
            if at in table:
                raise ValueError(f"`milestones` repeats milestone {at}; each milestone may appear once.")
            table[at] = _check_k(pair[1], f"milestones[{at}]")
        self._milestones = sorted(table)
        self._ks = [table[m] for m in self._milestones]

    @property
    def milestones(self) -> dict[int, int]:
        """A copy of the ``{milestone: k}`` table, sorted."""
        return dict(zip(self._milestones, self._ks, strict=True))

    @override
    def k(self, progress: Progress) -> int:
        """The ``k`` of the last milestone reached by ``progress`` in ``unit`` (1 before the first)."""
        i = bisect.bisect_right(self._milestones, progress.value(self.unit))  # type: ignore[arg-type]
        return self._ks[i - 1] if i else 1

    @override
    def __repr__(self) -> str:
        return f"Piecewise({self.milestones!r}, unit={self.unit!r})"


class Ramp(Schedule):
    """Batch-size warm-up: ``k`` moves from ``start`` to ``end`` over ``over`` units, then stays.

    ``over`` is the ramp's length in ``unit`` (samples by default, or items, or optimizer
    steps). ``shape="linear"`` interpolates ``k``; ``"exponential"`` interpolates ``log k``
    (doubling at even intervals from 1 to a power of two). ``k`` is rounded down to a multiple
    of ``multiple_of`` but never leaves ``[start, end]``; ``end`` must be such a multiple. So a
    ``start`` that is not a multiple is used as it is until the ramp reaches the next multiple:
    ``Ramp(3, 8, over=8, unit="step", multiple_of=4)`` gives k = 3, 3, 4, 4, 4, 4, 4, 4, then 8.
    ``start > end`` ramps down (e.g. a shrinking batch for fine-tuning).

    Example:

        >>> ramp = Ramp(1, 8, over=70_000, unit="samples")
        >>> [ramp(Progress(samples=s)) for s in (0, 10_000, 35_000, 70_000)]
        [1, 2, 4, 8]
    """

    rank_consistent = True

    def __init__(
        self,
        start: int,
        end: int,
        over: int,
        unit: Unit = "samples",
        shape: Literal["linear", "exponential"] = "linear",
        multiple_of: int = 1,
    ) -> None:
        self.start = _check_k(start, "start")
        self.end = _check_k(end, "end")
        self.over = _check_k(over, "over", what=f"the ramp's length in `unit`, {unit!r}")
        self.unit = _check_unit(unit, UNITS)
        if shape not in ("linear", "exponential"):
            raise ValueError(f"`shape` must be 'linear' or 'exponential'; got {shape!r}.")
        self.shape = shape
        self.multiple_of = _check_k(multiple_of, "multiple_of")
        if self.end % self.multiple_of:
            raise ValueError(
                f"`end`={end} is not a multiple of `multiple_of`={multiple_of}; the ramp could never reach it."
            )

    @override
    def k(self, progress: Progress) -> int:
        """The ramp's ``k`` at ``progress`` in ``unit``: ``start`` to ``end`` over ``over``, then ``end``."""
        t = progress.value(self.unit) / self.over  # type: ignore[arg-type]
        if t >= 1:
            return self.end
        if self.shape == "linear":
            raw = self.start + (self.end - self.start) * t
        else:
            raw = self.start * (self.end / self.start) ** t
        # the tiny slack keeps e.g. 3.9999999999 from flooring to 3
        k = math.floor(raw / self.multiple_of + 1e-9) * self.multiple_of
        return min(max(k, min(self.start, self.end)), max(self.start, self.end))

    @override
    def __repr__(self) -> str:
        return (
            f"Ramp({self.start}, {self.end}, over={self.over}, unit={self.unit!r}, "
            f"shape={self.shape!r}, multiple_of={self.multiple_of})"
        )


class Lambda(Schedule):
    """Any function of ``Progress``; its result is validated like every schedule's.

    Example:

        >>> Lambda(lambda p: 1 + p.epoch)(Progress(epoch=3))
        4
    """

    def __init__(self, fn: Callable[[Progress], int], unit: Unit | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"`fn` must be callable as fn(progress) -> int; got {fn!r}.")
        self.fn = fn
        self.unit = None if unit is None else _check_unit(unit, UNITS)

    @override
    def k(self, progress: Progress) -> int:
        """What ``fn(progress)`` gives."""
        return self.fn(progress)

    @override
    def __repr__(self) -> str:
        suffix = "" if self.unit is None else f", unit={self.unit!r}"
        return f"Lambda({self.fn!r}{suffix})"


OPEN_ENDED = 2**31 - 1
"""The ``k`` of a ``Budget`` without ``max_k``: no cap on a window's micro-batches (its budget closes it)."""


class Budget(Schedule):
    """Windows closed by a budget: a window closes after the first micro-batch at which its count over all
    ranks (``unit``: ``"items"``, e.g. tokens from ``count``, or ``"samples"``) reaches ``n``.

    A micro-batch is never split, so a window holds at least ``n`` (at most one micro-batch more), unless
    ``max_k`` closes it first (the most micro-batches a window holds) or the epoch ends (a short last window,
    as for any schedule). ``n`` may follow progress itself: a schedule (``Budget(Ramp(...))``) or a function of
    ``Progress``, read when the window opens. A micro-batch is what the adapter counts as one: a loader batch
    for ``AccumulationScheduler`` (``microbatch_size`` pieces included), an ``accumulate`` block for the mixin
    and ``FabricAccumulator``; its count is taken before its ``training_step`` (``count(batch)``, or its samples).

    ``k(progress)`` is the cap (``max_k``, or ``OPEN_ENDED``); ``budget(progress)`` is ``n``.

    Example:

        >>> b = Budget(4096, unit="items", max_k=16)
        >>> b.budget(Progress()), b(Progress())
        (4096, 16)
        >>> Budget(Ramp(1000, 4000, over=10_000, unit="items")).budget(Progress(items=5_000))
        2500
    """

    def __init__(
        self,
        n: int | Schedule | Callable[[Progress], int],
        unit: Literal["items", "samples", "tokens", "item", "sample", "token"] = "items",
        max_k: int | None = None,
    ) -> None:
        self.unit = _check_unit(unit, ("samples", "items"))
        self.max_k = None if max_k is None else _check_k(max_k, "max_k", "the most micro-batches a window holds")
        if isinstance(n, Schedule):
            if n.measures_noise or isinstance(n, Budget):
                why = (
                    "it measures the gradient noise in windows of a fixed k, which a budget does not give"
                    if n.measures_noise
                    else "a budget is not a number"
                )
                raise ValueError(
                    f"`n` of `Budget` cannot be {n!r}: {why}. Give an int, a schedule of Progress such as "
                    "`Ramp(...)`, or a function of Progress."
                )
            self.n: Schedule = n
        elif isinstance(n, numbers.Real) and not isinstance(n, bool):
            if not isinstance(n, numbers.Integral) or int(n) < 1:
                raise ValueError(
                    f"`n` of `Budget` must be an int >= 1 (the {self.unit} a window reaches); got {n!r}. "
                    "e.g. `Budget(500_000, unit='items')`."
                )
            self.n = Constant(int(n))
        elif callable(n) and not isinstance(n, type):
            self.n = Lambda(n)
        else:
            raise TypeError(
                f"`n` of `Budget` must be an int >= 1, a Schedule (e.g. `Ramp(...)`) or a function of Progress "
                f"giving one; got {n!r}."
            )
        self.rank_consistent = self.n.rank_consistent

    def budget(self, progress: Progress) -> int:
        """``n`` for a window opening at ``progress`` (an int >= 1, checked)."""
        value = self.n.k(progress)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
            raise ValueError(f"{self!r} gave a budget n={value!r} at {progress}; it must be an int >= 1.")
        return int(value)

    @override
    def k(self, progress: Progress) -> int:
        """The cap on a window's micro-batches: ``max_k``, or ``OPEN_ENDED``."""
        return OPEN_ENDED if self.max_k is None else self.max_k

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the budget: the state of the schedule ``n`` follows (a constant's is empty)."""
        return self.n.state_dict()

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned into the schedule ``n`` follows."""
        self.n.load_state_dict(state_dict)

    @override
    def __repr__(self) -> str:
        n = repr(self.n._k) if isinstance(self.n, Constant) else repr(self.n)
        cap = "" if self.max_k is None else f", max_k={self.max_k}"
        return f"Budget({n}, unit={self.unit!r}{cap})"


def as_schedule(schedule: Schedule | int | Mapping[int, int]) -> Schedule:
    """Accept what Lightning users already write: an ``int`` or an epoch-keyed ``dict``."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, Mapping):
        return Piecewise(schedule, unit="epoch")
    if isinstance(schedule, numbers.Integral) and not isinstance(schedule, bool):
        return Constant(int(schedule))
    raise TypeError(
        f"`schedule` must be a Schedule, an int k or an epoch-keyed dict like {{0: 1, 4: 2}}; got {schedule!r}."
    )
