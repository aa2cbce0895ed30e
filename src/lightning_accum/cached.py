"""Cached backward (GradCache, Gao et al. 2021) for losses that couple the whole batch.

A contrastive loss couples every sample to every other, so it is not a sum over micro-batches
and plain accumulation changes it. The cached backward keeps it exact with one chunk's graph
alive at a time: (1) each encoder runs on each chunk without a graph, and the chunk's RNG state
is kept; (2) the loss runs on all representations at once, as leaves, and back-propagates into
them (and into any parameter of the loss itself, such as a learned temperature); (3) each chunk
runs again with a graph, its RNG state replayed, and back-propagates its representations'
cached gradient: ``dL/dtheta = sum_j (dr_j/dtheta)^T dL/dr_j``.

The functions take the passes to run (the mixin's, which scale and skip the gradient sync), so
the arithmetic here is plain autograd and is tested on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accum import microbatch

Reps = Tensor | tuple[Tensor, ...]
Gather = Callable[[Sequence[Tensor]], tuple[list[Tensor], int]]  # all ranks' rows, and where this rank's start


def check_args(encoders: Sequence[Callable[[Any], Reps]], inputs: Sequence[Any], chunk_size: object) -> int:
    """The batch size shared by ``inputs``, or a ``ValueError`` naming the bad argument."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be an int >= 1 (samples per chunk); got {chunk_size!r}.")
    for name, given in (("encoders", encoders), ("inputs", inputs)):
        if isinstance(given, nn.Module | Tensor | str | dict) or not isinstance(given, Sequence):
            raise TypeError(
                f"`{name}` must be a list, one entry per tower (e.g. `encoders=[model]`, `inputs=[batch]`); "
                f"got {type(given).__name__}."
            )
    if len(encoders) != len(inputs) or not encoders:
        raise ValueError(
            f"`encoders` has {len(encoders)} entries and `inputs` {len(inputs)}; give one encoder per input "
            "(the same encoder twice for a shared tower)."
        )
    sizes = [microbatch.batch_length(x) for x in inputs]
    if len(set(sizes)) > 1:
        raise ValueError(f"`inputs` differ in size along dim 0 ({sizes}); every input must hold the same samples.")
    if not sizes[0]:
        raise ValueError(
            "`inputs` hold no samples (dim 0 is 0): a batch-coupled loss needs at least one; skip the call."
        )
    return sizes[0]


class _RNG:
    """The CPU and CUDA generator states at one point, to run a chunk's forward again alike."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=range(len(self.cuda or ())), enabled=True):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


def _parts(reps: object, where: str) -> tuple[Tensor, ...]:
    parts = reps if isinstance(reps, tuple) else (reps,)
    if any(isinstance(t, Tensor) and t.ndim == 0 for t in parts):
        raise ValueError(
            f"{where} returned a 0-d tensor; it must return one row per sample of its chunk (dim 0), e.g. the "
            "embeddings, not a loss or a reduced value."
        )
    if not parts or not all(isinstance(t, Tensor) for t in parts):
        raise ValueError(f"{where} returned {type(reps).__name__}; it must return a tensor or a tuple of tensors.")
    return parts  # type: ignore[return-value]


def _leaf(rep: Tensor) -> Tensor:
    """A representation as a leaf of the loss; half precision goes to float32, so that the cached
    gradient keeps its precision (and a GradScaler's scale cannot overflow it)."""
    if not rep.is_floating_point():
        return rep
    return (rep.float() if rep.element_size() < 4 else rep.detach()).requires_grad_()


def _norm_buffers(modules: Sequence[nn.Module]) -> list[tuple[Tensor, Tensor]]:
    """Running statistics of the batch-norm layers, to undo the first (graph-free) pass's update."""
    norms = [m for root in modules for m in root.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return [(b, b.detach().clone()) for m in norms for b in m.buffers()]


def backward_cached(
    encoders: Sequence[Callable[[Any], Reps]],
    inputs: Sequence[Any],
    loss_fn: Callable[..., Tensor],
    chunk_size: int,
    loss_backward: Callable[[Tensor], None],
    reps_backward: Callable[[Sequence[Tensor], Sequence[Tensor]], None],
    *,
    gather: Gather | None = None,
    world: int = 1,
    modules: Sequence[nn.Module] = (),
) -> Tensor:
    """The cached backward of ``loss_fn(*[encoder(x) for encoder, x in zip(encoders, inputs)])``.

    ``loss_backward(loss)`` runs the loss's backward (into the leaves); ``reps_backward(reps,
    grads)`` a chunk's. ``gather`` puts all ``world`` ranks' representations into the loss
    and says which rows are this rank's; their cached gradient is then multiplied by ``world``,
    so that the ranks' mean is the gathered loss's gradient. Batch-norm running statistics of
    ``modules`` move once per sample. Returns the loss, detached.
    """
    check_args(encoders, inputs, chunk_size)
    chunks = [microbatch.split(x, chunk_size) for x in inputs]
    norms = _norm_buffers(modules)
    states: list[list[_RNG]] = [[] for _ in encoders]
    leaves: list[tuple[Tensor, ...]] = []
    offsets: list[int] = []  # where this rank's rows start among the loss's
    with torch.no_grad():
        for i, (encoder, parts) in enumerate(zip(encoders, chunks, strict=True)):
            outs = []
            for part in parts:
                states[i].append(_RNG())
                outs.append(_parts(encoder(part), f"encoder {i}"))
            reps = [torch.cat(column) for column in zip(*outs, strict=True)]
            offset = 0
            if gather is not None:
                reps, offset = gather(reps)
            offsets.append(offset)
            leaves.append(tuple(_leaf(r) for r in reps))
        after = _RNG()
        for buffer, saved in norms:
            buffer.copy_(saved)
    loss = loss_fn(*[leaf[0] if len(leaf) == 1 else leaf for leaf in leaves])
    loss_backward(loss)
    grads = [[t.grad for t in leaf] for leaf in leaves]
    del leaves
    for i, parts in enumerate(chunks):
        start = offsets[i]
        for j, part in enumerate(parts):
            rows = slice(start, start + microbatch.batch_length(part))
            start = rows.stop
            with states[i][j].replay():
                again = _parts(encoders[i](part), f"encoder {i}")
            pairs = [(r, g[rows]) for r, g in zip(again, grads[i], strict=True) if g is not None and r.requires_grad]
            if pairs:
                cached = [(g * world if world != 1 else g).to(r.dtype) for r, g in pairs]
                reps_backward([r for r, _ in pairs], cached)
    torch.set_rng_state(after.cpu)
    if after.cuda is not None:
        torch.cuda.set_rng_state_all(after.cuda)
    return loss.detach()
