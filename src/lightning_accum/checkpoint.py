"""What a checkpoint written inside a window holds besides the window's counts: its partial
gradient, and under DDP every rank's own part (each rank's partial gradient, counts and noise
measurement stay its own until the window's end; Lightning saves one rank's callback state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_accum import collectives, gradients

Partial = list[Tensor | None]


def save_partial(
    strategy: Any, numbers: Sequence[float], params: Sequence[Tensor], pending: Partial | None = None
) -> dict[str, Any]:
    """The partial gradient of ``params`` (``pending``: one restored from a checkpoint and not put
    back yet) and, on several ranks, every rank's ``numbers`` and partial gradient."""
    grads = list(pending) if pending is not None else gradients.snapshot(params)
    state: dict[str, Any] = {"grads": grads}
    if collectives.world_size(strategy) > 1:
        state["ranks"] = collectives.gather_partial(strategy, numbers, params, grads)
    return state


def load_partial(state: Mapping[str, Any], strategy: Any, rank: int) -> tuple[list[float] | None, Partial | None]:
    """This rank's numbers (``None`` in a checkpoint of one process) and partial gradient."""
    ranks = state.get("ranks")
    if ranks is None:
        return None, state.get("grads")
    world = collectives.world_size(strategy)
    if len(ranks) != world:
        raise ValueError(
            f"This checkpoint was saved inside an accumulation window on {len(ranks)} ranks, whose partial "
            f"gradients differ; it cannot resume on {world}. Resume on {len(ranks)} ranks, or from a checkpoint "
            "saved at an optimizer step."
        )
    numbers, grads = ranks[rank]
    return list(numbers), list(grads)
