"""Cached backward (GradCache, Gao et al. 2021) for losses that couple the whole batch.

A contrastive loss couples every sample to every other, so it is not a sum over micro-batches
and plain accumulation changes it. The cached backward keeps it exact with one chunk's graph
alive at a time: (1) each encoder runs on each chunk without a graph, and the chunk's RNG state
is kept (and every buffer the pass writes is put back afterwards); (2) the loss runs on all
representations at once, as leaves, and back-propagates into them (and into any parameter of the
loss itself, such as a learned temperature); (3) each chunk runs again with a graph, its RNG state
replayed, and back-propagates its representations' cached gradient:
``dL/dtheta = sum_j (dr_j/dtheta)^T dL/dr_j``. Towers are chunked each on its own, so a query
tower and a passage tower with hard negatives (B against B x (1 + n) samples) fit.

The functions take the passes to run (the mixin's, which scale and skip the gradient sync), so
the arithmetic here is plain autograd and is tested on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accum import microbatch

Reps = Tensor | tuple[Tensor, ...]
"""What an encoder (or ``get_rep``) gives for a chunk: one tensor, or a tuple, each with a row per sample."""
Gather = Callable[[Sequence[Tensor]], tuple[list[Tensor], int]]  # all ranks' rows, and where this rank's start
GetRep = Callable[[Any], Reps]
"""``get_rep(output)``: the representation(s) in an encoder's output, e.g.
``lambda out: out.last_hidden_state[:, 0]``."""


def check_args(
    encoders: Sequence[Callable[..., Any]], inputs: Sequence[Any], chunk_size: object, get_rep: object = None
) -> tuple[list[int], list[GetRep | None]]:
    """Each tower's chunk size and representation picker, or an error naming the bad argument."""
    for name, given in (("encoders", encoders), ("inputs", inputs)):
        if isinstance(given, nn.Module | Tensor | str | Mapping) or not isinstance(given, Sequence):
            raise TypeError(
                f"`{name}` must be a list, one entry per tower (e.g. `encoders=[model]`, `inputs=[batch]`); "
                f"got {type(given).__name__}."
            )
    if len(encoders) != len(inputs) or not encoders:
        raise ValueError(
            f"`encoders` has {len(encoders)} entries and `inputs` {len(inputs)}; give one encoder per input "
            "(the same encoder twice for a shared tower)."
        )
    sizes = _per_tower("chunk_size", chunk_size, len(encoders))
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"`chunk_size` must be an int >= 1 (samples per chunk), or one per encoder; got {chunk_size!r}."
            )
    pickers = _per_tower("get_rep", get_rep, len(encoders))
    for picker in pickers:
        if picker is not None and not callable(picker):
            raise TypeError(
                f"`get_rep` must be a callable on an encoder's output (e.g. `lambda out: "
                f"out.last_hidden_state[:, 0]`), or one per encoder; got {get_rep!r}."
            )
    for i, x in enumerate(inputs):
        if not microbatch.batch_length(x):
            raise ValueError(
                f"`inputs[{i}]` holds no samples (dim 0 is 0): a batch-coupled loss needs at least one; skip the call."
            )
    return sizes, pickers  # type: ignore[return-value]


def _per_tower(name: str, value: object, towers: int) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != towers:
            raise ValueError(f"`{name}` has {len(value)} entries for {towers} encoders; give one, or one per encoder.")
        return list(value)
    return [value] * towers


def _encode(encoder: Callable[..., Any], part: Any, get_rep: GetRep | None, where: str) -> tuple[Tensor, ...]:
    """The representations of one chunk: a Mapping goes in as keyword arguments (``input_ids=``, ...)."""
    out = encoder(**part) if isinstance(part, Mapping) else encoder(part)
    return _parts(out if get_rep is None else get_rep(out), where)


class _RNG:
    """The CPU and CUDA generator states at one point, to run a chunk's forward again alike."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=range(len(self.cuda or ())), enabled=True):
            self.restore()
            yield

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _parts(reps: object, where: str) -> tuple[Tensor, ...]:
    parts = reps if isinstance(reps, tuple) else (reps,)
    if any(isinstance(t, Tensor) and t.ndim == 0 for t in parts):
        raise ValueError(
            f"{where} returned a 0-d tensor; it must return one row per sample of its chunk (dim 0), e.g. the "
            "embeddings, not a loss or a reduced value."
        )
    if not parts or not all(isinstance(t, Tensor) for t in parts):
        raise ValueError(
            f"{where} returned {type(reps).__name__}; it must return a tensor or a tuple of tensors (give `get_rep=` "
            "to pick them from an output object, e.g. `lambda out: out.last_hidden_state[:, 0]`)."
        )
    return parts  # type: ignore[return-value]


def _leaf(rep: Tensor) -> Tensor:
    """A representation as a leaf of the loss; half precision goes to float32, so that the cached
    gradient keeps its precision (and a GradScaler's scale cannot overflow it)."""
    if not rep.is_floating_point():
        return rep
    return (rep.float() if rep.element_size() < 4 else rep.detach()).requires_grad_()


class _Buffers:
    """Every buffer of ``modules`` as it was, to undo what the graph-free pass wrote: a forward that
    changes state in training mode (BatchNorm's running statistics, ``spectral_norm``'s power
    iteration, any buffer written in place or reassigned) then runs once per sample, in the second
    pass. Put back whole (a copy each, on its device): a kernel may write a buffer without a trace
    (BatchNorm's), and comparing would read every buffer on the host."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._saved = [
            (module, name, buffer, buffer.detach().clone())
            for root in modules
            for module in root.modules()
            for name, buffer in module.named_buffers(recurse=False)
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buffer, copy in self._saved:
                if module._buffers.get(name) is not buffer:  # reassigned by the forward
                    module._buffers[name] = buffer
                buffer.copy_(copy)
        self._saved = []


def backward_cached(
    encoders: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    loss_fn: Callable[..., Tensor],
    chunk_size: int | Sequence[int],
    loss_backward: Callable[[Tensor], None],
    reps_backward: Callable[[Sequence[Tensor], Sequence[Tensor]], None],
    *,
    gather: Gather | None = None,
    world: int = 1,
    modules: Sequence[nn.Module] = (),
    get_rep: GetRep | Sequence[GetRep | None] | None = None,
) -> Tensor:
    """The cached backward of ``loss_fn(*[encoder(x) for encoder, x in zip(encoders, inputs)])``.

    Each input is chunked along dim 0 on its own (towers may hold different numbers of samples;
    ``chunk_size`` is one int, or one per encoder); a Mapping input (a dict, a ``BatchEncoding``) goes
    to its encoder as keyword arguments, and ``get_rep`` (one, or one per encoder) picks the
    representation from the encoder's output. ``loss_backward(loss)`` runs the loss's backward
    (into the leaves); ``reps_backward(reps, grads)`` a chunk's. ``gather`` puts all ``world`` ranks'
    representations into the loss and says which rows are this rank's; their cached gradient is
    then multiplied by ``world``, so that the ranks' mean is the gathered loss's gradient. The
    buffers of ``modules`` move once per sample; the RNG ends where the whole batch's forward and
    loss leave it. Returns the loss, detached.
    """
    sizes, pickers = check_args(encoders, inputs, chunk_size, get_rep)
    chunks = [microbatch.split(x, size) for x, size in zip(inputs, sizes, strict=True)]
    buffers = _Buffers(modules)
    states: list[list[_RNG]] = [[] for _ in encoders]
    leaves: list[tuple[Tensor, ...]] = []
    offsets: list[int] = []  # where this rank's rows start among the loss's
    with torch.no_grad():
        for i, (encoder, parts) in enumerate(zip(encoders, chunks, strict=True)):
            outs = []
            for part in parts:
                states[i].append(_RNG())
                outs.append(_encode(encoder, part, pickers[i], f"encoder {i}"))
            reps = [torch.cat(column) for column in zip(*outs, strict=True)]
            del outs  # (the chunks' outputs: one copy of the representations is enough)
            offset = 0
            if gather is not None:
                reps, offset = gather(reps)
            offsets.append(offset)
            leaves.append(tuple(_leaf(r) for r in reps))
            del reps
        buffers.restore()
    loss = loss_fn(*[leaf[0] if len(leaf) == 1 else leaf for leaf in leaves])
    loss_backward(loss)
    after = _RNG()  # where the whole batch's forward and loss leave the generators
    loss = loss.detach()  # (its graph held the leaves)
    grads = [[t.grad for t in leaf] for leaf in leaves]
    del leaves
    for i, parts in enumerate(chunks):
        start = offsets[i]
        for j, part in enumerate(parts):
            rows = slice(start, start + microbatch.batch_length(part))
            start = rows.stop
            with states[i][j].replay():
                again = _encode(encoders[i], part, pickers[i], f"encoder {i}")
            pairs = [(r, g[rows]) for r, g in zip(again, grads[i], strict=True) if g is not None and r.requires_grad]
            del again
            if pairs:
                cached = [(g * world if world != 1 else g).to(r.dtype) for r, g in pairs]
                reps_backward([r for r, _ in pairs], cached)
                del pairs, cached
    after.restore()
    return loss
