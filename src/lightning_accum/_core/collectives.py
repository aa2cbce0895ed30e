"""Collectives of a window's end: the gradient and the counts made global, once per window.

Every rank must normalise its window by the same global counts, so the local counts are
summed over ranks in a single all-reduce of one small integer tensor. Where the package
reduces gradients itself (the mixin under DDP), it does so in flat buckets, one collective
round per optimizer step whatever the number of backward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 25 * 2**20  # like DDP's default bucket: bounds the transient flat buffer


def world_size(strategy: Any) -> int:
    """Ranks that average gradients (1 on a single device)."""
    return int(getattr(strategy, "world_size", 1) or 1)


#: a number, a device scalar, or the parts of a sum (several scalars, or a tensor of several elements)
Value = float | Tensor | Sequence[float | Tensor]


def sum_over_ranks(
    strategy: Any, values: Sequence[Value], local: Sequence[Value] = ()
) -> tuple[list[float], list[float | list[float]]]:
    """On the host: each of ``values`` summed (over its parts, and over all ranks), and each of ``local``
    as this rank has it (a float, or a list for several parts). One collective (none on a single
    device) and one host read of every tensor there is (none when all are Python numbers on a single
    device); sums of parts read on a single device are taken exactly (``math.fsum``)."""
    if world_size(strategy) > 1:
        device = torch.device(strategy.root_device)
        stacked = torch.stack([_device_sum(v, device) for v in values])
        values = list(strategy.reduce(stacked, reduce_op="sum").unbind())
    entries = [*values, *local]
    read = iter(host_values([t for v in entries for t in _parts(v) if isinstance(t, Tensor)]))  # the one host read
    out: list[float | list[float]] = []
    for v in entries:
        numbers = [x for part in _parts(v) for x in _take(part, read)]
        single = not isinstance(v, list | tuple) and not (isinstance(v, Tensor) and v.dim() > 0)
        out.append(numbers[0] if single else numbers)
    totals = [math.fsum(n) if isinstance(n, list) else n for n in out[: len(values)]]
    return totals, out[len(values) :]


_HOST_GROUPS: dict[int, Any] = {}  # a gloo group for host numbers, made once per default process group


def host_group() -> Any:
    """A process group whose collectives run on the host (gloo): the default group if it is gloo, else one made
    once (every rank must call this at the same point the first time: a budget window's first micro-batch)."""
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    key = id(world)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS.clear()  # (a group of a process group destroyed since)
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


def host_sum(strategy: Any, value: int) -> int:
    """A host integer summed over ranks: one small all-reduce on a gloo group (no device synchronisation), none
    on a single process. Blocking: the rank waits here for every other rank's value."""
    if world_size(strategy) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=host_group())
    return int(tensor[0])


class HostSum:
    """Host integers summed over ranks without waiting for them: the all-reduce (one, of ``len(values)`` int64, on
    the host's gloo group) is issued when this is made and waited for by ``result``, so that the rank's work in
    between overlaps the other ranks' arrival. On a single process nothing is sent and ``result`` is ``values``.

    Every rank must make the same ``HostSum`` s in the same order (as for any collective); one that is dropped
    unread still completes, once every rank has issued it.

    Example:

        >>> HostSum(None, [3, 1]).result()
        [3, 1]
    """

    __slots__ = ("_tensor", "_values", "_work")

    def __init__(self, strategy: Any, values: Sequence[int]) -> None:
        self._values: list[int] | None = None
        self._work: Any = None
        if world_size(strategy) == 1:
            self._values, self._tensor = [int(v) for v in values], None
            return
        self._tensor = torch.tensor(list(values), dtype=torch.int64)
        self._work = dist.all_reduce(self._tensor, op=dist.ReduceOp.SUM, group=host_group(), async_op=True)

    def result(self) -> list[int]:
        """The sums (waits for the collective the first time, if it has not completed)."""
        if self._values is None:
            self._work.wait()
            self._values, self._work = [int(v) for v in self._tensor.tolist()], None  # type: ignore[union-attr]
        return self._values


def host_values(tensors: Sequence[Tensor]) -> list[float]:
    """Every element of ``tensors``, in order, on the host: one stack (or, for tensors of several devices or
    shapes, one concatenation on the first one's device) and one host read (none for no tensor)."""
    if not tensors:
        return []
    try:
        stacked = torch.stack(list(tensors))
    except RuntimeError:  # (devices or shapes that differ)
        stacked = torch.cat([t.reshape(-1).to(tensors[0].device) for t in tensors])
    return (stacked if stacked.dim() == 1 else stacked.reshape(-1)).tolist()  # type: ignore[no-any-return]


def _parts(value: Value) -> Sequence[float | Tensor]:
    if isinstance(value, float | int | Tensor):
        return [value]
    return value


def _take(part: float | Tensor, read: Iterator[float]) -> list[float]:
    if isinstance(part, Tensor):
        return [next(read) for _ in range(part.numel())]
    return [float(part)]


def _device_sum(value: Value, device: torch.device) -> Tensor:
    parts = [torch.as_tensor(p).to(device, torch.float64).reshape(-1) for p in _parts(value)]
    return torch.cat(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)


def check_same_k(strategy: Any, k: int, schedule: object) -> None:
    """Raise on every rank, in the window's first collective, if the ranks' ``k`` differ (they would
    otherwise step at different batches and hang in the next gradient collective)."""
    if world_size(strategy) == 1:
        return
    sums = strategy.reduce(torch.tensor([k, k * k], dtype=torch.int64, device=strategy.root_device), reduce_op="sum")
    total, squares = (int(v) for v in sums.tolist())
    if world_size(strategy) * squares == total * total:  # equality of the sums holds only if all k are equal
        return
    ks = [int(v) for v in strategy.all_gather(torch.tensor(k, device=strategy.root_device)).reshape(-1).tolist()]
    raise RuntimeError(
        f"The ranks disagree on the window's size: the schedule {schedule!r} gave k = {ks} on ranks 0..{len(ks) - 1}. "
        "Every rank must get the same k: compute it from the `Progress` it is given (summed over ranks), not from "
        "rank-local state such as the local batch or a rank-local random generator."
    )


def check_same_window(strategy: Any, total: float, squares: float) -> None:
    """Raise on every rank if the ranks' windows differ (``total`` and ``squares``: a window's identity and its
    square, summed over ranks; all equal exactly when ``world * squares == total ** 2``)."""
    if world_size(strategy) * round(squares) != round(total) ** 2:
        raise RuntimeError(
            "The ranks closed different accumulation windows (their epoch or first micro-batch differ): a rank's "
            "data ran out before the others', or an exception was caught on one rank only, and their gradients "
            "would mix different windows. Every rank must run the same number of micro-batches per epoch (e.g. "
            "`DistributedSampler(drop_last=True)`, loaders of equal length) and fail, or go on, together."
        )


def mean_over_ranks(strategy: Any, values: Sequence[float]) -> list[float]:
    """Floats averaged over ranks in one collective (as they are on a single device)."""
    if world_size(strategy) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=strategy.root_device)
    return [float(v) for v in strategy.reduce(tensor, reduce_op="mean").tolist()]


def all_reduce_gradients(
    strategy: Any,
    params: Sequence[Tensor],
    present_anywhere: Sequence[int],
    slot: Callable[[Tensor], Tensor] | None = None,
) -> int:
    """Average the gradients of ``params`` over ranks, in flat buckets; returns the collectives used.

    ``present_anywhere[i]`` says on how many ranks ``params[i]`` has a gradient (from the window's
    count all-reduce): a parameter with a gradient on some rank gets zeros where it has none, so
    that every rank reduces the same buffers; one with a gradient nowhere stays ``None``. ``slot(p)``:
    the tensor that holds ``p``'s window gradient (zeros made where it has none; ``.grad`` by default,
    under ``grad_accum_dtype`` a narrow parameter's wide sum, reduced in that dtype).
    """
    world = world_size(strategy)
    if world == 1:
        return 0
    grads = [(slot or _grad_slot)(p) for p, present in zip(params, present_anywhere, strict=True) if present]
    calls = 0
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        _all_reduce_sum(flat)
        flat.div_(world)
        for g, piece in zip(bucket, torch.split(flat, [g.numel() for g in bucket]), strict=True):
            g.copy_(piece.view_as(g))
        calls += 1
    return calls


def _grad_slot(p: Tensor) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


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


def gather_partial(
    strategy: Any,
    numbers: Sequence[float],
    params: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    dtypes: Sequence[torch.dtype] | None = None,
) -> list[tuple[list[float], list[Tensor | None]]]:
    """Every rank's ``numbers`` and partial gradient (``grads`` of ``params``, ``None`` where a rank
    has none; kept in ``dtypes``, each parameter's own by default), on every rank, on the CPU: what a
    checkpoint inside a window must hold under DDP, where each rank's partial gradient and counts are its
    own until the window's end. Exact (through float64); a checkpoint-time cost of ``world_size`` gradients."""
    kept = [p.dtype for p in params] if dtypes is None else list(dtypes)
    device = strategy.root_device
    present = torch.tensor([g is not None for g in grads], dtype=torch.uint8, device=device)
    pieces = [
        torch.zeros(p.numel(), dtype=torch.float64, device=device) if g is None else g
        for p, g in zip(params, grads, strict=True)
    ]
    flat = torch.cat(
        [torch.zeros(0, dtype=torch.float64, device=device)] + [g.reshape(-1).to(device, torch.float64) for g in pieces]
    )
    values = torch.tensor(list(numbers), dtype=torch.float64, device=device)
    all_present, all_flat, all_values = (strategy.all_gather(t).cpu() for t in (present, flat, values))
    out = []
    for rank in range(world_size(strategy)):
        split = torch.split(all_flat[rank], [p.numel() for p in params])
        rank_grads = [
            piece.view(p.shape).to(kept[i]) if all_present[rank][i] else None
            for i, (p, piece) in enumerate(zip(params, split, strict=True))
        ]
        out.append(([float(v) for v in all_values[rank]], rank_grads))
    return out


def gather_rows(strategy: Any, tensors: Sequence[Tensor]) -> tuple[list[Tensor], int]:
    """Every rank's rows of each of ``tensors`` (dim 0, the same number in each; ranks' numbers
    may differ), concatenated in rank order, and the index where this rank's start. One
    all-gather of the sizes and one per tensor, no autograd."""
    n = tensors[0].shape[0]
    sizes = [int(v) for v in strategy.all_gather(torch.tensor([n], device=tensors[0].device)).reshape(-1).tolist()]
    top, out = max(sizes), []
    for tensor in tensors:
        if n < top:
            tensor = torch.cat([tensor, tensor.new_zeros((top - n, *tensor.shape[1:]))])
        everything = strategy.all_gather(tensor.contiguous())
        out.append(torch.cat([everything[r, : sizes[r]] for r in range(len(sizes))]))
    return out, sum(sizes[: strategy.global_rank])


def sum_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each of ``tensors`` summed over ranks, element by element (every rank gives the same shapes and
    dtypes), as new tensors: one all-reduce per device and dtype, of their flat concatenation. What
    the backward of an all-gather is: each rank's gradient of every rank's rows, added up."""
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for indices in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        _all_reduce_sum(flat)
        for i, piece in zip(indices, torch.split(flat, [tensors[i].numel() for i in indices]), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]
