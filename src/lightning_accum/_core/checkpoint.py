"""What a checkpoint written inside a window holds besides the window's counts: its partial
gradient, and under DDP every rank's own part (each rank's partial gradient, counts and noise
measurement stay its own until the window's end; Lightning saves one rank's callback state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_accum._core import collectives, gradients
from lightning_accum._core.wide import WideSums

Partial = list[Tensor | None]


def save_partial(
    strategy: Any,
    numbers: Sequence[float],
    params: Sequence[Tensor],
    pending: Partial | None = None,
    wide: WideSums | None = None,
) -> dict[str, Any]:
    """The partial gradient of ``params`` (``pending``: one restored from a checkpoint and not put
    back yet; ``wide``: where ``grad_accum_dtype`` keeps the narrow parameters' sums, saved in that dtype)
    and, on several ranks, every rank's ``numbers`` and partial gradient."""
    if pending is not None:
        grads = list(pending)
    elif wide is None:
        grads = gradients.snapshot(params)
    else:
        grads = [None if g is None else g.detach().to("cpu", copy=True) for g in wide.current(params)]
    world = collectives.world_size(strategy)
    state: dict[str, Any] = {"grads": grads, "world_size": world}
    if world > 1:
        dtypes = None if wide is None else [wide.dtype_of(p) for p in params]
        state["ranks"] = collectives.gather_partial(strategy, numbers, params, grads, dtypes)
    return state


def check_world(state: Mapping[str, Any], strategy: Any, checkpoint: object = None) -> None:
    """Refuse to resume a window a checkpoint holds part of on another number of ranks than it was saved
    on (``checkpoint``: its name, for the message), in either direction: each rank's partial gradient and
    counts are its own until the window's end, and another world size would split the data otherwise."""
    ranks = state.get("ranks")
    saved = int(state.get("world_size", 1 if ranks is None else len(ranks)))
    world = collectives.world_size(strategy)
    if saved != world:
        name = "The checkpoint" if checkpoint is None else f"The checkpoint {str(checkpoint)!r}"
        raise ValueError(
            f"{name} was saved inside an accumulation window on {saved} rank(s), whose partial gradients are each "
            f"rank's own; it cannot resume on {world}. Resume it on {saved} rank(s), or resume on {world} from a "
            "checkpoint saved at an optimizer step (e.g. `ModelCheckpoint(every_n_train_steps=...)`, or `fabric.save` "
            "right after a step)."
        )


def load_partial(
    state: Mapping[str, Any], strategy: Any, rank: int, checkpoint: object = None
) -> tuple[list[float] | None, Partial | None]:
    """This rank's numbers (``None`` in a checkpoint of one process) and partial gradient; refused on another
    number of ranks than the checkpoint's (``check_world``)."""
    check_world(state, strategy, checkpoint)
    ranks = state.get("ranks")
    if ranks is None:
        return None, state.get("grads")
    numbers, grads = ranks[rank]
    return list(numbers), list(grads)


class PartialWindow:
    """A window a checkpoint holds part of, for either adapter: saved with its partial gradient; after
    a resume put back in two steps, this rank's numbers at train start (``numbers``) and the gradient
    where the resumed window may add to it (``put_back``: after any zeroing of its next batch).

    Example:

        >>> partial = PartialWindow()
        >>> partial.load({"window": None})  # a checkpoint without a partial gradient
        >>> partial.numbers(strategy=None, rank=0) is None
        True
    """

    def __init__(self) -> None:
        self._state: Mapping[str, Any] | None = None  # the checkpoint's state, until train start
        self._grads: Partial | None = None  # the partial gradient, until it is put back
        #: whether a partial gradient waits to be put back (an attribute: read before every backward pass)
        self.pending = False

    def save(
        self, strategy: Any, numbers: Sequence[float], params: Sequence[Tensor], wide: WideSums | None = None
    ) -> dict[str, Any]:
        """What a checkpoint holds of the open window (``numbers``: this rank's counts; ``wide``: the narrow
        parameters' sums under ``grad_accum_dtype``). Saved again before what a checkpoint held was put back (a
        save right after a load), that is what it holds."""
        if self._state is not None:
            return {key: self._state[key] for key in ("grads", "world_size", "ranks") if key in self._state}
        return save_partial(strategy, numbers, params, self._grads, wide)

    def load(self, state: Mapping[str, Any]) -> None:
        self._state = state if "grads" in state else None
        self._grads, self.pending = None, False

    @property
    def loaded(self) -> bool:
        return self._state is not None

    @staticmethod
    def check(state: Mapping[str, Any], strategy: Any, checkpoint: object = None) -> None:
        """Refuse a checkpoint holding part of a window on another number of ranks (``check_world``), as it
        loads: before anything of it is restored."""
        if "grads" in state:
            check_world(state, strategy, checkpoint)

    def numbers(self, strategy: Any, rank: int, checkpoint: object = None) -> list[float] | None:
        """At train start: this rank's numbers (``None`` without a partial window or in a one-process checkpoint);
        refused on another number of ranks than the checkpoint's (``checkpoint``: its name, for the message)."""
        if self._state is None:
            return None
        numbers, self._grads = load_partial(self._state, strategy, rank, checkpoint)
        self._state, self.pending = None, self._grads is not None
        return numbers

    def forget(self) -> None:
        """Drop a partial gradient still waiting (its window was discarded: the loop stopped inside it)."""
        self._grads, self.pending = None, False

    def put_back(self, params: Sequence[Tensor], wide: WideSums | None = None) -> Partial | None:
        """Put the partial gradient back into ``params`` (once: a narrow parameter's into its sum in ``wide``, as
        saved); returns it (``None`` if none waited)."""
        grads = self._grads
        if grads is not None:
            restore_partial(params, grads, wide)
            self._grads, self.pending = None, False
        return grads


def restore_partial(params: Sequence[Tensor], grads: Partial, wide: WideSums | None = None) -> None:
    """A window's partial gradient (as a checkpoint saved it) back into ``params``: a narrow parameter's into its sum
    in ``wide`` (``grad_accum_dtype``), exactly as saved, any other's into ``.grad``; checked whole first. A param
    group added to the optimizer since the checkpoint (``BaseFinetuning``'s, at the batch the fit resumed at) comes
    after the saved parameters and has no partial gradient."""
    if len(grads) < len(params):
        grads = [*grads, *[None] * (len(params) - len(grads))]
    gradients.placed(params, grads)
    if wide is None:
        gradients.restore(params, grads)
        return
    rest = {id(p) for p in wide.restore(params, grads)}
    kept = [(p, g) for p, g in zip(params, grads, strict=True) if id(p) in rest]
    gradients.restore([p for p, _ in kept], [g for _, g in kept])
