"""How many samples a micro-batch holds: dim 0 of its first tensor, else Lightning's own search
through the batch (which is why this lives on the Lightning side of the package, beside the
adapters that count each micro-batch, and not in ``window``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_accum._lightning import extract_batch_size

_SEQUENCES = (list, tuple)  # (one tuple of types, not built again on every call)


def sample_count(batch: Any, needed_by: str | None) -> int:
    """Samples in a micro-batch: dim 0 of its first tensor, depth first (fast path; in a retrieval
    batch ``{"queries": {...}, "passages": {...}}``, the queries), else Lightning's search; where neither
    finds one (a batch class of the user's own), 0 if nothing needs it, else an error: ``needed_by`` names
    what needs it (a schedule keyed on samples, the noise scale in samples)."""
    first = batch
    while True:  # the first tensor, depth first (a tuple of types: faster than a union on the hot path)
        if isinstance(first, _SEQUENCES) and first:
            first = first[0]
        elif isinstance(first, dict) and first:
            first = next(iter(first.values()))
        else:
            break
    if isinstance(first, Tensor) and first.ndim:
        return int(first.shape[0])
    try:
        return extract_batch_size(batch)
    except Exception:  # Lightning's MisconfigurationException: no tensor it can read a size from
        if needed_by is None:
            return 0
    raise ValueError(
        f"{needed_by} needs each micro-batch's number of samples, but a batch of type `{type(batch).__name__}` "
        "holds no tensor to read it from. Give batches as tensors (or dicts, lists, tuples or dataclasses of "
        "them), or key the schedule on 'step', 'epoch' or 'items' (items are given by `count=`)."
    )
