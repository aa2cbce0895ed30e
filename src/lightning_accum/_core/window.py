"""One accumulation window: what went in, and the factor that normalises its gradient.

A window opens with the ``k`` its schedule gave and counts, on this rank, the micro-batches
that were back-propagated, their samples and their items (tokens, ...). At its end the counts
are summed over ranks (``lightning_accum._core.sync``) and ``Window.gradient_scale`` gives
the factor that turns the accumulated gradient into the window's mean.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_accum._core.samples import sample_count

Normalize = Literal["mean", "items"]
"""How a window's gradient is normalised: ``"mean"`` (the mean of its micro-batches' gradients over all
ranks) or ``"items"`` (its summed per-item gradient over its global item count)."""
NORMALIZE: tuple[str, ...] = ("mean", "items")


@dataclass(slots=True)
class Window:
    """Counts of one window on one rank.

    Attributes:
        k: micro-batches the schedule gave when the window opened.
        start: index, within its epoch, of the window's first batch.
        divisor: the number every micro-batch loss was divided by before backward (Lightning's
            ``accumulate_grad_batches`` in automatic optimization, 1 where nothing divides).
        microbatches: micro-batches back-propagated so far.
        samples: samples in those micro-batches.
        items: items in those micro-batches; device tensors are kept unsynchronised until the
            window ends, so counting costs no host-device round trip per micro-batch.
        synced: whether the latest backward pass ran with the gradient sync on (FSDP and FSDP2
            with sync skipped reduce only in the window's last micro-batch).
        budget: under a ``Budget``, the count (samples or items, over all ranks) that closes the window,
            read when it opened; ``None`` otherwise (``k`` closes it).
        seen: under a ``Budget``, the window's count so far over all ranks, in the budget's unit.
        seen_last: what the latest micro-batch added to ``seen`` (taken back with it by ``remove``).
        ends: under a ``Budget``, whether the latest micro-batch asked about closes the window.
        asked: under a ``Budget``, the micro-batches asked about so far (``reach``): what ``max_k`` (``k``) caps, the
            loader batches of the callback's window, whether their ``training_step`` returned a loss or not.
        reached: under a ``Budget``, whether the latest micro-batch's count is in ``seen`` but the micro-batch is not
            counted yet (``add``): an exception before it went in takes it back (``unreach``).
    """

    k: int
    start: int = 0
    divisor: int = 1
    microbatches: int = 0
    samples: int = 0
    items: int = 0
    pending_items: list[Tensor] = field(default_factory=list)
    synced: bool = False
    budget: int | None = None
    seen: int = 0
    seen_last: int = 0
    ends: bool = False
    asked: int = 0
    reached: bool = False

    def add(self, samples: int, items: int | Tensor) -> None:
        """Count one back-propagated micro-batch (all or nothing: a bad count changes no counter)."""
        if isinstance(items, Tensor):  # (a copy: a count the batch holds, or a loader's reused buffer, may change)
            self.pending_items.append(check_count(items).detach().reshape(()).to(torch.float64, copy=True))  # type: ignore[union-attr]
        else:
            self.items += items if type(items) is int and items >= 0 else check_item_count(items)
        self.microbatches += 1
        self.samples += samples
        self.reached = False

    def remove(self, samples: int, items: int | Tensor) -> None:
        """Take back the latest ``add`` (a micro-batch whose backward never ran)."""
        if isinstance(items, Tensor):
            self.pending_items.pop()
        else:
            self.items -= int(items)
        self.microbatches -= 1
        self.samples -= samples
        if self.budget is not None:
            self._take_back_reach()

    def reach(self, seen: int) -> bool:
        """Under a ``Budget``: add a micro-batch's count over all ranks (``seen``, before the micro-batch is
        counted by ``add``); whether the window closes after it (its budget reached, or ``k`` micro-batches)."""
        assert self.budget is not None
        self.seen += seen
        self.seen_last, self.reached = seen, True
        self.asked += 1
        self.ends = self.seen >= self.budget or self.asked >= self.k
        return self.ends

    def keep_reach(self) -> None:
        """The micro-batch ``reach`` counted is over (it went in, or ran no backward pass, as a ``training_step``
        returning ``None``): its count stays in ``seen``."""
        self.reached = False

    def unreach(self) -> None:
        """Take back the count ``reach`` added for a micro-batch that never went in (an exception before it was
        counted); nothing if it went in."""
        if self.reached:
            self._take_back_reach()

    def _take_back_reach(self) -> None:
        """The latest ``reach`` undone: its count out of ``seen``, its micro-batch out of ``asked``."""
        self.seen -= self.seen_last
        self.asked -= 1
        self.seen_last, self.ends, self.reached = 0, False, False

    def mark_synced(self, synced: bool) -> None:
        """Whether the latest backward pass ran with the gradient sync on."""
        self.synced = synced

    def set_counts(self, microbatches: int, samples: int, items: int) -> None:
        """This rank's counts as a checkpoint held them."""
        self.microbatches, self.samples, self.items = microbatches, samples, items

    def local_items(self) -> int:
        """This rank's item count; resolves device counts with one host transfer."""
        if self.pending_items:
            self.settle_items(torch.stack(self.pending_items).tolist())
        return self.items

    def items_on_device(self) -> int | Tensor:
        """This rank's item count without a host transfer (a device scalar where counts are tensors)."""
        if not self.pending_items:
            return self.items
        return self.items + torch.stack(self.pending_items).sum()

    def settle_items(self, values: Sequence[float]) -> None:
        """The device counts (``pending_items``), read: checked and added to ``items``."""
        self.pending_items.clear()
        counts = [check_item_count(v, f"the window's tensor count {i}, from `count(batch)` or `items=`")
                  for i, v in enumerate(values)]  # fmt: skip
        self.items += sum(counts)

    @property
    def full(self) -> bool:
        return self.microbatches >= self.k

    def gradient_scale(
        self, normalize: str, *, world_size: int = 1, global_microbatches: int = 0, global_items: int = 0
    ) -> float:
        """Factor for the accumulated gradient: what was summed, over what it must be divided by.

        The accumulated gradient is ``sum(g_i) / divisor`` on each rank, averaged over
        ``world_size`` ranks by the data-parallel all-reduce. ``"mean"`` wants the mean over all
        micro-batches of all ranks, ``"items"`` wants the sum of per-item losses over the global
        item count; both scales are exact rationals of integers, computed once in float64.
        """
        if normalize == "mean":
            total = global_microbatches or self.microbatches * world_size
            return self.divisor * world_size / total if total else 1.0
        if normalize == "items":
            return self.divisor * world_size / global_items if global_items else 0.0
        raise ValueError(f"`normalize` must be one of {NORMALIZE}; got {normalize!r}.")

    def state_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "start": self.start,
            "divisor": self.divisor,
            "microbatches": self.microbatches,
            "samples": self.samples,
            "items": self.local_items(),
            **({} if self.budget is None else self._budget_state()),
        }

    def _budget_state(self) -> dict[str, Any]:
        return {"budget": self.budget, "seen": self.seen, "ends": self.ends, "asked": self.asked}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Window:
        window = cls(k=int(state["k"]), start=int(state["start"]), divisor=int(state["divisor"]))
        window.microbatches, window.samples = int(state["microbatches"]), int(state["samples"])
        window.items = int(state["items"])
        if state.get("budget") is not None:
            window.budget, window.seen = int(state["budget"]), int(state["seen"])
            window.ends, window.asked = bool(state.get("ends", False)), int(state.get("asked", window.microbatches))
        return window


def batch_counts(
    batch: Any, needed_by: str | None, count: Callable[[Any], Any] | None, samples: int | None = None
) -> tuple[int, int | Tensor]:
    """A batch's samples (dim 0 of its first tensor, ``sample_count``, unless given) and items (``count(batch)``,
    checked by ``check_count``; its samples without a ``count``), as a micro-batch of it is counted: as it goes in,
    or read ahead from the loader.

    Example:

        >>> import torch
        >>> batch = {"ids": torch.zeros(4, 9), "mask": torch.ones(4, 9)}
        >>> batch_counts(batch, None, None), batch_counts(batch, None, lambda b: int(b["mask"].sum()))
        ((4, 4), (4, 36))
    """
    samples = sample_count(batch, needed_by) if samples is None else samples
    return samples, samples if count is None else check_count(count(batch))


def check_count(value: object, what: str = "`count(batch)`") -> int | Tensor:
    """A micro-batch's item count as given (``what``: where it came from), checked before anything uses it:
    an ``int >= 0`` (an integral float too), or a one-element tensor, whose value is read with the window's
    counts at its end (and checked then: a tensor's value is not read on the host per micro-batch)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            shape = f"a {value.dtype} tensor" if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
            raise ValueError(
                f"{what} returned {shape}; it must be the micro-batch's total number of items as one number (an int, "
                "or a one-element integer tensor), e.g. `batch['mask'].sum()` rather than `.sum(1)`."
            )
        return value
    return check_item_count(value, f"from {what}")


def check_item_count(value: object, what: str = "from `count(batch)`, or `items=`") -> int:
    """An item count as an ``int >= 0``, or a clear error naming ``count``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"A micro-batch's item count ({what}) was {value!r}; it must be the micro-batch's number of items "
            "(tokens, ...) as an int >= 0 or a one-element integer tensor."
        )
    return int(value)


def microbatch_items(
    declared: int | Tensor | None, implicit: bool, counted: int | Tensor | None, samples: int
) -> int | Tensor:
    """A micro-batch's item count, whatever the number of its backward passes: the ``items=`` its passes
    declared (each pass its own), plus ``count(batch)`` once if a pass declared none (``implicit``); without
    either, its samples.

    Example:

        >>> microbatch_items(None, True, 12, 4), microbatch_items(3, True, 12, 4), microbatch_items(3, False, 12, 4)
        (12, 15, 3)
    """
    if declared is None:
        return counted if counted is not None else samples
    return declared + counted if implicit and counted is not None else declared


def pass_items(declared: int | Tensor | None, mean: bool, counted: int | Tensor | None) -> int | Tensor | None:
    """The item count a backward pass's loss is weighted by: the ``items=`` the pass declared (its loss a mean over
    them); else, for a mean loss (``reduction="mean"``, ``mean``), the micro-batch's ``count(batch)``: each such pass
    is a mean over the micro-batch's items, which ``microbatch_items`` counts once; else ``None`` (a sum, as it is).

    Example:

        >>> pass_items(3, True, 12), pass_items(None, True, 12), pass_items(None, False, 12)
        (3, 12, None)
    """
    if declared is not None:
        return declared
    return counted if mean else None


def lr_factor(lr_scaling: str | None, unit: str | None, k: int, samples: int, items: int, first: int | None) -> float:
    """The learning-rate multiplier ``lr_scaling`` gives a window's step: the window's size over the first window's
    (``first``), as it is (``"linear"``) or its square root (``"sqrt"``); 1 without ``lr_scaling``, or before a first
    window. The size is ``k`` under a schedule of k (``unit`` is ``None``); under a ``Budget``, the window's count
    over all ranks in the budget's ``unit`` (``"samples"``: ``samples``, ``"items"``: ``items``), and ``first`` the
    first window's budget: a budget window of count 0 (closed by ``max_k`` or the epoch's end) gets 0, its step moves
    nothing. (AdaScale's factor is a gain measured on the gradient: ``lightning_accum.lr.adascale_gain``.)

    Example:

        >>> lr_factor("linear", None, 8, 64, 64, 2), lr_factor("sqrt", "items", 3, 12, 24, 6)
        (4.0, 2.0)
        >>> lr_factor("linear", "items", 2, 8, 0, 6), lr_factor(None, None, 8, 64, 64, 2)
        (0.0, 1.0)
    """
    if lr_scaling is None or not first:
        return 1.0
    ratio = (k if unit is None else samples if unit == "samples" else items) / first
    return ratio if lr_scaling == "linear" else math.sqrt(ratio)


def wide_divisor(k: int) -> int:
    """What each loss of a window of ``k`` is divided by before backward under ``grad_accum_dtype``: the power of two
    at or above ``k``, which scales a bf16 or fp16 gradient exactly (where ``1/k`` would be rounded), keeps an fp16
    gradient in range as dividing by ``k`` does, and leaves the window's exact division to its close.

    Example:

        >>> [wide_divisor(k) for k in (1, 2, 3, 4, 5, 8, 9, 64, 100)]
        [1, 2, 4, 4, 8, 8, 16, 64, 128]
    """
    return 1 << (k - 1).bit_length()


def lightning_divisor(start: int, k: int) -> int:
    """The ``accumulate_grad_batches`` value that makes Lightning close a window of ``k``
    opened at batch index ``start`` exactly after its ``k``-th batch.

    Lightning steps when ``(batch_idx + 1) % value == 0`` and zeroes when
    ``batch_idx % value == 0``. ``value = k`` works when ``start`` is a multiple of ``k``;
    otherwise ``value = start + k`` is the only step point in ``start+1 .. start+k``, and the
    window's first batch is not a zeroing point, so the caller zeroes it.
    """
    return k if start % k == 0 else start + k
