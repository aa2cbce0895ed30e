"""How many samples a micro-batch holds: dim 0 of its first tensor that has a dim 0, depth first through
the batch (the adapters count each micro-batch with it; Progress.samples, the reports and every schedule
keyed on samples read it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

_SEQUENCES = (list, tuple)  # (one tuple of types, not built again on every call)
_NOT_SEARCHED = (str, bytes, bytearray)  # (iterable, but of characters: no tensor inside)


def sample_count(batch: Any, needed_by: str | None) -> int:
    """Samples in a micro-batch: dim 0 of its first tensor with at least one dimension, depth first (in a
    retrieval batch ``{"queries": {...}, "passages": {...}}``, the queries). What has no dim 0 is skipped: a
    Python number, a string, a 0-dim tensor (``{"tokens": mask.sum(), "x": ...}`` counts ``x``'s rows).
    Where the batch holds no such tensor (a batch class of the user's own, only 0-dim tensors), 0 if nothing
    needs it, else an error: ``needed_by`` names what needs it (a schedule keyed on samples, the noise scale in
    samples)."""
    first = batch
    while True:  # fast path: the first leaf, depth first (a tuple of types: faster than a union on the hot path)
        if isinstance(first, _SEQUENCES) and first:
            first = first[0]
        elif isinstance(first, dict) and first:
            first = next(iter(first.values()))
        else:
            break
    if isinstance(first, Tensor) and first.ndim:
        return int(first.shape[0])
    found, scalars = _search(batch, depth=0)
    if found is not None:
        return found
    if needed_by is None:
        return 0
    held = (
        "holds only 0-dim tensors (no dim 0 to count samples along)" if scalars else "holds no tensor to read it from"
    )
    raise ValueError(
        f"{needed_by} needs each micro-batch's number of samples (dim 0 of its first tensor that has one), but a "
        f"batch of type `{type(batch).__name__}` {held}. Give batches with a per-sample tensor (or dicts, lists, "
        "tuples or dataclasses of them), or key the schedule on 'step', 'epoch' or 'items' (items are given by "
        "`count=`)."
    )


def _search(obj: Any, depth: int) -> tuple[int | None, bool]:
    """Dim 0 of the first tensor under ``obj`` with at least one dimension (``None``: none), and whether a 0-dim
    tensor was passed over on the way."""
    if isinstance(obj, Tensor):
        return (int(obj.shape[0]), False) if obj.ndim else (None, True)
    if depth > 64 or isinstance(obj, _NOT_SEARCHED):  # (a structure that nests itself: nothing more to find)
        return None, False
    if isinstance(obj, Mapping):
        children: Iterable[Any] = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = (getattr(obj, field.name) for field in dataclasses.fields(obj))
    elif isinstance(obj, Iterable):
        children = obj
    else:
        return None, False
    scalars = False
    for child in children:
        found, passed = _search(child, depth + 1)
        if found is not None:
            return found, scalars
        scalars = scalars or passed
    return None, scalars
