"""Optimizer groups of the mixin: which of the module's optimizers step together, and their parameters.

A group is keyed by the sorted indices of its optimizers in ``self.optimizers()``; ``None``
names the group of all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from lightning_accum import gradients

GroupKey = tuple[int, ...]


def optimizers(module: Any) -> list[Any]:
    """The module's (Lightning-wrapped) optimizers, as a list."""
    found = module.optimizers()
    return list(found) if isinstance(found, list | tuple) else [found]


def key(module: Any, optimizer: Any) -> GroupKey:
    """The group of ``optimizer``: ``None`` (all), an optimizer, its index, or a list of them."""
    known = optimizers(module) if getattr(module, "_trainer", None) is not None else []
    if optimizer is None:
        return tuple(range(len(known)))
    chosen = []
    for o in optimizer if isinstance(optimizer, list | tuple) else [optimizer]:
        if isinstance(o, int) and 0 <= o < len(known):
            chosen.append(o)
            continue
        raw = getattr(o, "optimizer", o)
        matches = [i for i, lo in enumerate(known) if lo is o or lo.optimizer is raw]
        if not matches:
            raise ValueError(f"`optimizer` must be one of `self.optimizers()` or its index; got {o!r}.")
        chosen.append(matches[0])
    return tuple(sorted(set(chosen)))


def params(module: Any, group: GroupKey | None = None) -> list[Tensor]:
    """The parameters of the group's optimizers (all optimizers for ``None``), in order."""
    known = optimizers(module)
    chosen = range(len(known)) if group is None else group
    return [p for i in chosen for p in gradients.optimizer_params(known[i].optimizer)]


def check_disjoint(module: Any, new: GroupKey, known: Iterable[GroupKey]) -> None:
    """Refuse a window group whose parameters another group's window also accumulates into: each
    window's step would take the other's gradient too."""
    mine = {id(p) for p in params(module, new)}
    names = {id(p): name for name, p in module.named_parameters()}
    for other in known:
        if other == new:
            continue
        shared = [names.get(id(p), "?") for p in params(module, other) if id(p) in mine]
        if shared:
            listed = ", ".join(shared[:5]) + (", ..." if len(shared) > 5 else "")
            raise ValueError(
                f"The windows of optimizers {list(new)} and {list(other)} would share parameters ({listed}), so each "
                "window's step would take the other window's gradient too. Accumulate them in one window "
                "(`self.accumulate(batch, optimizer=[...])` naming all of them, or no `optimizer=`), or give each "
                "optimizer its own parameters."
            )
