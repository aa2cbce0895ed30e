"""Gradient operations on an optimizer's parameters, one fused pass per device and dtype.

Every op works on the ``.grad`` tensors that exist; parameters whose ``.grad`` is ``None``
stay ``None``. The ``torch._foreach_*`` kernels need tensors of one device and dtype, so the
gradients are grouped first; a model has few groups, so the Python cost is per group, not per
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle


def optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    """The parameters of every param group, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def group_sizes(optimizer: Optimizer) -> tuple[int, ...]:
    """How many parameters each param group holds: it changes when a group is added during the fit."""
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The existing ``.grad`` tensors of ``params``."""
    return [p.grad for p in params if p.grad is not None]


def optimizer_grads(optimizer: Optimizer) -> list[Tensor]:
    """The existing ``.grad`` tensors of an optimizer's parameters."""
    return grads_of(optimizer_params(optimizer))


def norms(grads: Sequence[Tensor]) -> list[Tensor]:
    """Each gradient's L2 norm, as device scalars (no host sync), a tensor two optimizers share counted
    once: the window's gradient norm is the root of their squares' sum, taken where they are read."""
    if len(set(map(id, grads))) < len(grads):
        grads = list({id(g): g for g in grads}.values())
    return [n for group in _groups(grads) for n in torch._foreach_norm(group)]


def _groups(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    return list(by_key.values())


_HALVES = (torch.bfloat16, torch.float16)  # (a constant: `scale_` is on the window-end path, built once)


def scale_(grads: Sequence[Tensor], factor: float) -> None:
    """``g *= factor`` for every gradient, computed in float32 at least and rounded once to the gradient's dtype; no
    work at all for ``factor == 1``. (On the CPU ``torch._foreach_mul_`` rounds a Python scalar to a bf16 or fp16
    list's own dtype first, 0.1428 for 1/7 in bf16: bf16 and fp16 gradients there are scaled one tensor at a time.)"""
    if factor == 1.0 or not grads:
        return
    for group in _groups(grads):
        if group[0].device.type == "cpu" and group[0].dtype in _HALVES:
            for g in group:
                g.mul_(factor)
        else:
            torch._foreach_mul_(group, factor)


def zero_(grads: Sequence[Tensor]) -> None:
    """``g.zero_()`` for every gradient, the buffers kept (``set_to_none=False``)."""
    for group in _groups(grads):
        torch._foreach_zero_(group)


def squared_norm(grads: Sequence[Tensor]) -> Tensor:
    """The squared L2 norm of all gradients together, as a float64 scalar (no host sync)."""
    parts = [torch.stack(torch._foreach_norm(group)).double().square().sum() for group in _groups(grads)]
    if not parts:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([p.to(parts[0].device) for p in parts]).sum()


def snapshot(params: Sequence[Tensor]) -> list[Tensor | None]:
    """CPU copies of the gradients of ``params`` (``None`` where there is none), for checkpoints."""
    return [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]


def placed(params: Sequence[Tensor], saved: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Gradients saved by ``snapshot``, checked against ``params`` and moved to their device and dtype."""
    if len(saved) != len(params):
        raise ValueError(
            f"The checkpoint holds gradients for {len(saved)} parameters but the optimizer has {len(params)}; "
            "resume with the same model and optimizer."
        )
    out: list[Tensor | None] = []
    for p, g in zip(params, saved, strict=True):
        if g is not None and g.shape != p.shape:
            raise ValueError(
                f"A saved gradient of shape {tuple(g.shape)} does not fit a parameter of {tuple(p.shape)}."
            )
        out.append(None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True))
    return out


def restore(params: Sequence[Tensor], saved: Sequence[Tensor | None]) -> None:
    """Put gradients saved by ``snapshot`` back, on each parameter's device and dtype."""
    for p, g in zip(params, placed(params, saved), strict=True):
        p.grad = g


def no_items(items: float | Tensor) -> bool | Tensor:
    """Whether a micro-batch's item count is 0: a ``bool``, or a 0-d bool tensor for a tensor count
    (not read on the host; for ``add_nothing_if``)."""
    return items.detach().reshape(()) == 0 if isinstance(items, Tensor) else not items


def add_nothing_if(params: Iterable[Tensor], empty: bool | Tensor) -> list[RemovableHandle]:
    """``add_nothing`` where ``empty`` holds (as ``no_items`` gives it): ``True``, ``False`` (no hook),
    or a 0-d bool tensor, decided on the device without a host read."""
    if not isinstance(empty, Tensor):
        return add_nothing(params) if empty else []
    return [
        p.register_hook(lambda g: g.masked_fill(empty.to(g.device), 0))  # type: ignore[no-untyped-call]
        for p in params
        if p.requires_grad
    ]


def zero_where(grads: Sequence[Tensor], empty: bool | Tensor) -> list[Tensor]:
    """``grads`` with nothing in them where ``empty`` holds (as ``no_items`` gives it): a gradient that a
    pass of no items sends on by hand (a shared trunk's, cached representations'), its NaN included."""
    if empty is False:
        return list(grads)
    if isinstance(empty, Tensor):
        return [g.masked_fill(empty.to(g.device), 0) for g in grads]
    return [torch.zeros_like(g) for g in grads]


def add_nothing(params: Iterable[Tensor]) -> list[RemovableHandle]:
    """Make the next backward pass add nothing to these parameters' gradients, NaN included (a mean
    over no items, ``sum / 0``, has a NaN gradient that no factor on the loss can cancel): each
    gradient is replaced by zeros before it is accumulated. Remove the handles after the pass."""
    return [p.register_hook(torch.zeros_like) for p in params if p.requires_grad]  # type: ignore[no-untyped-call]
