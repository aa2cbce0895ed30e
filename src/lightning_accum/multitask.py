"""Sequential backward: several losses back-propagated one at a time, one graph alive at once.

``(loss_a + loss_b).backward()`` keeps every task's graph alive until the joint backward.
Back-propagating each task right after its forward frees its graph before the next task's
forward, so the peak holds one graph. With a shared trunk, the heads run on a detached leaf
copy of the trunk's output; each head back-propagates into it, and the trunk back-propagates
once with the summed feature gradient: the peak holds the trunk's graph plus one head's.

Both functions take the ``backward`` to use (the mixin's, which scales and skips DDP sync),
so the arithmetic here is plain autograd and is tested on its own.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor
from typing_extensions import override

__all__ = ["Backward", "GraphMemory", "backward_each", "backward_heads", "measure_graph_memory"]

Backward = Callable[[Tensor], None]
"""``backward(loss)``: what ``backward_each`` and ``backward_heads`` call on each (weighted) task loss,
e.g. ``lambda loss: loss.backward()``; the mixin passes its own, which divides by the window's divisor
and skips DDP's gradient sync inside a window."""


def _weights(weights: Sequence[float] | None, n: int, what: str) -> list[float]:
    if not n:
        raise ValueError(f"`{what}` is empty; give at least one.")
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ValueError(f"`weights` has {len(weights)} entries for {n} {what}; give one weight per {what[:-1]}.")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"`weights` must be finite numbers, one per {what[:-1]}; got {list(weights)!r}.")
    return [float(w) for w in weights]


def check_loss(loss: object, label: str) -> Tensor:
    """``loss`` as a scalar tensor with a graph, or a ``ValueError`` that says what ``label`` gave."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"{label} is {what}; it must be a scalar loss tensor.")
    if not loss.requires_grad:
        raise ValueError(
            f"{label} does not require grad; compute it from the model's outputs "
            "(not under `torch.no_grad()`, not `.detach()`-ed)."
        )
    return loss.reshape(())


def backward_each(
    backward: Backward | Callable[[Tensor, float], None],
    closures: Sequence[Callable[[], Tensor]],
    weights: Sequence[float] | None = None,
    *,
    grad_norms_of: Sequence[Tensor] | None = None,
    weighs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Run each closure's forward and ``backward(w_i * loss_i)`` in turn (``weighs=True``: ``backward(loss_i, w_i)``,
    for a ``backward`` that weighs the pass itself).

    Returns the detached per-task losses and, when ``grad_norms_of`` gives parameters, the L2
    norm of each task's weighted gradient on them (this costs one gradient copy per task).
    """
    ws = _weights(weights, len(closures), "closures")
    losses, norms = [], []
    for i, (closure, w) in enumerate(zip(closures, ws, strict=True)):
        before = None if grad_norms_of is None else _grad_copy(grad_norms_of)
        loss = check_loss(closure(), f"the loss of closure {i}")
        if weighs:
            backward(loss, w)  # type: ignore[call-arg]
        else:
            backward(loss * w if w != 1.0 else loss)  # type: ignore[call-arg]
        losses.append(loss.detach())
        if before is not None:
            norms.append(_increment_norm(grad_norms_of, before))  # type: ignore[arg-type]
    return torch.stack(losses), (torch.stack(norms) if norms else None)


def backward_heads(
    backward: Backward,
    features: Tensor,
    heads: Sequence[Callable[[Tensor], Tensor]],
    weights: Sequence[float] | None = None,
    *,
    trunk_backward: Callable[[Tensor, Tensor], None] | None = None,
) -> Tensor:
    """Back-propagate each head into a detached copy of ``features``, then the trunk once.

    ``heads[i](features) -> loss_i``. Gradients equal those of ``sum(w_i * loss_i).backward()``.
    ``trunk_backward(features, grad)`` runs the trunk's pass (default: plain autograd); the
    feature gradient already carries whatever scaling ``backward`` applied to the head losses.
    """
    if not isinstance(features, Tensor) or not features.requires_grad:
        raise ValueError(
            "`features` must be the trunk's output tensor, with its graph (it does not require grad); "
            "pass the trunk's output before any `.detach()`. A trunk with nothing to train (every parameter frozen, "
            "as before `BaseFinetuning` unfreezes it) gives no graph either, which cannot be told from a detached "
            "one: back-propagate the heads' losses with `acc.backward(sum(...))` (or `backward_each`) while it is."
        )
    ws = _weights(weights, len(heads), "heads")
    leaf = features.detach().requires_grad_(True)
    losses = []
    for i, (head, w) in enumerate(zip(heads, ws, strict=True)):
        loss = check_loss(head(leaf), f"the loss of head {i}")
        backward(loss * w if w != 1.0 else loss)
        losses.append(loss.detach())
    if leaf.grad is not None:
        (trunk_backward or _autograd_backward)(features, leaf.grad)
    return torch.stack(losses)


def _autograd_backward(features: Tensor | Sequence[Tensor], grad: Tensor | Sequence[Tensor]) -> None:
    torch.autograd.backward(features, grad_tensors=grad)


def _grad_copy(params: Sequence[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _increment_norm(params: Sequence[Tensor], before: Sequence[Tensor | None]) -> Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for p, b in zip(params, before, strict=True):
        if p.grad is None:
            continue
        delta = p.grad.detach() if b is None else p.grad.detach() - b
        total = total + delta.double().square().sum().cpu()
    return total.sqrt()


class GraphMemory:
    """Bytes of tensors saved for backward that are alive, and their peak, while measuring.

    Parameters are not counted (they exist anyway). Use ``measure_graph_memory``.

    Attributes:
        alive: bytes saved for backward and not yet freed (0 once every graph was used or dropped).
        peak: the most bytes that were alive at once: the graph memory the code inside needs.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {t.data_ptr() for t in exclude}
        self.alive = 0
        self.peak = 0

    @override
    def __repr__(self) -> str:
        return f"GraphMemory(peak={self.peak / 2**20:.2f} MiB, alive={self.alive / 2**20:.2f} MiB)"

    def _release(self, nbytes: int) -> None:
        self.alive -= nbytes

    def _pack(self, tensor: Tensor) -> _Saved:
        # (detached: a saved output held with its grad_fn would make a cycle through autograd's C++
        # objects, which no collector frees where the node never runs, e.g. a branch the loss does
        # not use; autograd puts the grad_fn back when it unpacks)
        saved = _Saved(tensor.detach())
        if tensor.data_ptr() not in self._exclude:
            nbytes = tensor.numel() * tensor.element_size()
            self.alive += nbytes
            self.peak = max(self.peak, self.alive)
            weakref.finalize(saved, self._release, nbytes)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> Tensor:
        return saved.tensor


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


@contextlib.contextmanager
def measure_graph_memory(exclude: Iterable[Tensor] = ()) -> Iterator[GraphMemory]:
    """Track the autograd graph memory (tensors saved for backward) of the code inside.

    Example:

        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        >>> with measure_graph_memory(exclude=net.parameters()) as memory:
        ...     net(torch.randn(4, 8)).sum().backward()
        >>> memory.peak > 0, memory.alive
        (True, 0)
    """
    memory = GraphMemory(exclude)
    with torch.autograd.graph.saved_tensors_hooks(memory._pack, memory._unpack):
        yield memory
