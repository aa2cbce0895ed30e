"""What a checkpoint written inside a window holds besides the window's counts: its partial
gradient, and under DDP every rank's own part (each rank's partial gradient, counts and noise
measurement stay its own until the window's end; Lightning saves one rank's callback state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_accum import collectives, gradients
from lightning_accum.engine import WindowEngine

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


NUMBERS = 7  # per engine: microbatches, samples, items, and the probe's four


def local_numbers(engine: WindowEngine) -> list[float]:
    """This rank's own part of the engine's open window: its counts and the noise probe's prefixes so far."""
    window = engine.window
    assert window is not None
    chain = [0.0] * 4 if engine.probe is None else engine.probe.numbers()
    return [window.microbatches, window.samples, window.local_items(), *chain]


def load_local_numbers(engine: WindowEngine, values: Sequence[float]) -> None:
    """Put back what ``local_numbers`` gave on this rank."""
    window = engine.window
    assert window is not None
    window.microbatches, window.samples, window.items = (int(v) for v in values[:3])
    if engine.probe is not None:
        engine.probe.load_numbers(values[3:7])
