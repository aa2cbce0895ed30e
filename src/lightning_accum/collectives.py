"""Collectives of a window's end: the gradient and the counts made global, once per window.

Every rank must normalise its window by the same global counts, so the local counts are
summed over ranks in a single all-reduce of one small integer tensor. Where the package
reduces gradients itself (the mixin under DDP), it does so in flat buckets, one collective
round per optimizer step whatever the number of backward passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 25 * 2**20  # like DDP's default bucket: bounds the transient flat buffer


def world_size(strategy: Any) -> int:
    """Ranks that average gradients (1 on a single device)."""
    return int(getattr(strategy, "world_size", 1) or 1)


def sum_over_ranks(strategy: Any, values: Sequence[int]) -> list[int]:
    """``values`` summed element-wise over all ranks; one collective, none on a single device."""
    if world_size(strategy) == 1:
        return [int(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.int64, device=strategy.root_device)
    return [int(v) for v in strategy.reduce(tensor, reduce_op="sum").tolist()]


def mean_over_ranks(strategy: Any, values: Sequence[Tensor | float]) -> list[float]:
    """Float values (scalars or 0-d tensors) averaged over ranks in one collective, as floats."""
    device = getattr(strategy, "root_device", None)
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if world_size(strategy) > 1:
        tensor = strategy.reduce(tensor, reduce_op="mean")
    return [float(v) for v in tensor.tolist()]


def all_reduce_gradients(strategy: Any, params: Sequence[Tensor], present_anywhere: Sequence[int]) -> int:
    """Average the gradients of ``params`` over ranks, in flat buckets; returns the collectives used.

    ``present_anywhere[i]`` says on how many ranks ``params[i]`` has a gradient (from the window's
    count all-reduce): a parameter with a gradient on some rank gets zeros where it has none, so
    that every rank reduces the same buffers; one with a gradient nowhere stays ``None``.
    """
    world = world_size(strategy)
    if world == 1:
        return 0
    grads: list[Tensor] = []
    for p, present in zip(params, present_anywhere, strict=True):
        if present:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    calls = 0
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        _all_reduce_sum(flat)
        flat.div_(world)
        for g, piece in zip(bucket, torch.split(flat, [g.numel() for g in bucket]), strict=True):
            g.copy_(piece.view_as(g))
        calls += 1
    return calls


def _all_reduce_sum(flat: Tensor) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)


def _buckets(grads: Sequence[Tensor]) -> Iterator[list[Tensor]]:
    """Same-device, same-dtype groups of at most ``BUCKET_BYTES``, in parameter order."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for group in groups.values():
        bucket: list[Tensor] = []
        size = 0
        for g in group:
            if bucket and size + g.numel() * g.element_size() > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket:
            yield bucket
