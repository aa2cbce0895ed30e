"""Cached backward (GradCache, Gao et al. 2021) for losses that couple the whole batch.

A contrastive loss couples every sample to every other, so it is not a sum over micro-batches
and plain accumulation changes it. The cached backward keeps it exact with one chunk's graph
alive at a time: (1) each encoder runs on each chunk without a graph, and the chunk's RNG state
is kept (and every buffer the pass writes is put back afterwards); (2) the loss runs on all
representations, as leaves, and back-propagates into them (and into any parameter of the loss
itself, such as a learned temperature); (3) each chunk runs again with a graph, its RNG state
replayed, and back-propagates its representations' cached gradient:
``dL/dtheta = sum_j (dr_j/dtheta)^T dL/dr_j``. Towers are chunked each on its own, so a query
tower and a passage tower with hard negatives (B against B x (1 + n) samples) fit.

Step (2) may run in blocks of the first tower's rows (``loss_chunk_size``): ``loss_fn(*reps,
rows=slice(i, i + m))`` returns the part of the loss those rows make (the parts sum to the
whole), and each part back-propagates before the next, so that one block of the score matrix
and its graph are alive, not all of it. With ``gather`` every rank's representations enter the
loss; in blocks, each rank scores only its own rows against every rank's, and the gradient of
every rank's representations is summed over ranks (``reduce``) before each rank replays its own
chunks. Chunks are row counts, or token budgets packed by the attention mask, with each chunk's
trailing padding columns trimmed. A tower that needs no gradient (its parameters frozen, or
``no_grad``) runs once: no RNG state kept, no replay, its buffer writes kept.

The functions take the passes to run (the mixin's, which scale and skip the gradient sync), so
the arithmetic here is plain autograd and is tested on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_accum._core import microbatch

Reps = Tensor | tuple[Tensor, ...]
"""What an encoder (or ``get_rep``) gives for a chunk: one tensor, or a tuple, each with a row per sample."""
Gather = Callable[[Sequence[Tensor]], tuple[list[Tensor], int]]  # all ranks' rows, and where this rank's start
Reduce = Callable[[Sequence[Tensor]], list[Tensor]]  # each tensor summed over ranks (the same shapes on every rank)
GetRep = Callable[[Any], Reps]
"""``get_rep(output)``: the representation(s) in an encoder's output, e.g.
``lambda out: out.last_hidden_state[:, 0]``."""

CallStyle = Literal["positional", "keywords", "whole"]


@dataclasses.dataclass
class Tower:
    """One tower, planned: its encoder and how it is called (a Mapping input as keyword arguments,
    or whole as the one argument), its input and chunks (rows ``start:stop``, and the width a chunk
    keeps where its trailing padding columns go), its representation picker, and whether it needs
    a gradient (``frozen``: it runs once)."""

    index: int
    encoder: Callable[..., Any]
    get_rep: GetRep | None
    frozen: bool
    input: Any
    rows: int
    chunks: list[tuple[int, int]]
    widths: list[int | None]
    style: CallStyle = "positional"

    @property
    def trimmed(self) -> bool:
        """Whether some chunk's padding columns are trimmed."""
        return any(w is not None for w in self.widths)

    def part(self, j: int) -> Any:
        """Chunk ``j``'s input (cut when it runs: the chunks' inputs are not kept)."""
        start, stop = self.chunks[j]
        width = self.widths[j]
        return _take(self.input, start, stop, width, self.input["attention_mask"].shape[1] if width else 0)

    def encode(self, part: Any) -> tuple[Tensor, ...]:
        """The representations of one chunk."""
        # ("whole": each call gets a dict of its own, cut for it, since a forward may add entries to it)
        out = self.encoder(**part) if self.style == "keywords" else self.encoder(part)
        if self.get_rep is not None:
            out = self.get_rep(out)
        elif isinstance(out, Mapping) and "sentence_embedding" in out:  # (a SentenceTransformer's output)
            out = out["sentence_embedding"]
        return _parts(out, f"encoder {self.index}")


def plan(
    encoders: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    loss_fn: Callable[..., Tensor],
    chunk_size: object,
    *,
    get_rep: object = None,
    chunk_tokens: object = None,
    no_grad: object = False,
    loss_chunk_size: object = None,
) -> list[Tower]:
    """Every argument checked (an error names the bad one, before anything runs), and each input
    cut into its chunks: of ``chunk_size`` rows, or packed up to ``chunk_tokens`` tokens (by the
    input's ``attention_mask``; at most ``chunk_size`` rows where both are given) with each chunk's
    trailing padding columns trimmed."""
    _check_towers(encoders, inputs)
    towers = len(encoders)
    sizes, budgets = _chunk_limits(chunk_size, chunk_tokens, towers)
    pickers = _per_tower("get_rep", get_rep, towers)
    for picker in pickers:
        if picker is not None and not callable(picker):
            raise TypeError(
                f"`get_rep` must be a callable on an encoder's output (e.g. `lambda out: "
                f"out.last_hidden_state[:, 0]`), or one per encoder; got {get_rep!r}."
            )
    flags = _per_tower("no_grad", no_grad, towers)
    if not all(isinstance(flag, bool) for flag in flags):
        raise TypeError(f"`no_grad` must be True or False, or one per encoder; got {no_grad!r}.")
    for i, encoder in enumerate(encoders):
        if not callable(encoder):
            raise TypeError(
                f"`encoders[{i}]` is a {type(encoder).__name__}; each encoder must be callable (a module, or a "
                "function of its input)."
            )
    if loss_chunk_size is not None:
        _count("loss_chunk_size", loss_chunk_size, loss_chunk_size, "rows of the first input per block of the loss")
        _check_rows_argument(loss_fn)
    return [
        _tower(i, encoder, x, sizes[i], budgets[i], pickers[i], flags[i])
        for i, (encoder, x) in enumerate(zip(encoders, inputs, strict=True))
    ]


def _check_towers(encoders: Sequence[Any], inputs: Sequence[Any]) -> None:
    """``encoders`` and ``inputs``: lists of one entry per tower, as many of each."""
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


def _chunk_limits(chunk_size: object, chunk_tokens: object, towers: int) -> tuple[list[int | None], list[int | None]]:
    """Each tower's rows per chunk and tokens per chunk (``None``: no limit), one of them at least."""
    sizes = [
        _count("chunk_size", s, chunk_size, "samples per chunk") for s in _per_tower("chunk_size", chunk_size, towers)
    ]
    budgets = [
        _count("chunk_tokens", t, chunk_tokens, "tokens per chunk")
        for t in _per_tower("chunk_tokens", chunk_tokens, towers)
    ]
    for i, (size, budget) in enumerate(zip(sizes, budgets, strict=True)):
        if size is None and budget is None:
            raise ValueError(
                f"Give `chunk_size` (samples per chunk) or `chunk_tokens` (tokens per chunk) for encoder {i}: "
                "one for all encoders, or one per encoder."
            )
    return sizes, budgets


def _tower(
    i: int, encoder: Callable[..., Any], x: Any, size: int | None, budget: int | None, picker: Any, no_grad: bool
) -> Tower:
    """Tower ``i``, planned: its input ``x`` cut into chunks of ``size`` rows (all of them for ``None``), or packed
    up to ``budget`` tokens (``_pack``), and how its encoder is called."""
    rows = _length(x, i)
    widths: list[int | None]
    if budget is None:
        size = size or rows
        chunks = [(s, min(s + size, rows)) for s in range(0, rows, size)]
        widths = [None] * len(chunks)
    else:
        chunks, widths = _pack(x, i, budget, size)
    tower = Tower(i, encoder, picker, no_grad or _frozen(encoder), x, rows, chunks, widths)
    tower.style = _call_style(encoder, tower.part(0), i)
    return tower


def _count(name: str, value: object, given: object, what: str) -> int | None:
    """A count argument as an int (any integer type), ``None`` as it is, or an error naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        per = "" if name == "loss_chunk_size" else ", or one per encoder"
        raise ValueError(f"`{name}` must be an int >= 1 ({what}){per}; got {given!r}.")
    return int(value)


def _per_tower(name: str, value: object, towers: int) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != towers:
            raise ValueError(f"`{name}` has {len(value)} entries for {towers} encoders; give one, or one per encoder.")
        return list(value)
    return [value] * towers


def _check_rows_argument(loss_fn: Callable[..., Tensor]) -> None:
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # (no signature to read: the call will tell)
        return
    if "rows" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    raise TypeError(
        "`loss_chunk_size` calls `loss_fn(*reps, rows=slice(i, i + m))` for each block of the first input's rows; "
        f"`loss_fn` takes {inspect.signature(loss_fn)}. Add a `rows` argument that returns the part of the loss "
        "those rows make (the parts sum to the whole), e.g. `cross_entropy(q[rows] @ d.T, labels[rows], "
        "reduction='sum') / len(q)`; or leave `loss_chunk_size` out."
    )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_tensor(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _length(x: Any, i: int) -> int:
    """Samples in an input (a Mapping's entries without a tensor, such as ``"modality": "text"``, are
    carried to every chunk as they are)."""
    splittable = {k: v for k, v in x.items() if _holds_tensor(v)} if isinstance(x, Mapping) else x
    try:
        rows = microbatch.batch_length(splittable)
    except ValueError as error:
        raise ValueError(f"`inputs[{i}]`: {error}") from None
    if not rows:
        raise ValueError(
            f"`inputs[{i}]` holds no samples (dim 0 is 0): a batch-coupled loss needs at least one; skip the call."
        )
    return rows


def _pack(x: Any, i: int, budget: int, size: int | None) -> tuple[list[tuple[int, int]], list[int | None]]:
    """Consecutive rows packed into chunks of at most ``budget`` tokens (a longer row alone) and at most
    ``size`` rows, and each chunk's width once its trailing padding columns go (``None``: none to trim)."""
    mask = x.get("attention_mask") if isinstance(x, Mapping) else None
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        raise ValueError(
            f"`chunk_tokens` counts the tokens of `inputs[{i}]` by its `attention_mask` (a 2-d tensor, samples x "
            f"tokens), which it does not hold; give `chunk_size` for this encoder (per encoder: `chunk_tokens=[N, "
            "None]` with `chunk_size=[None, m]`)."
        )
    width = mask.shape[1]
    active = mask != 0
    ends = torch.where(active, torch.arange(1, width + 1, device=mask.device), 0).amax(1) if width else active.sum(1)
    lengths, last = torch.stack([active.sum(1), ends]).tolist()  # (one host read)
    chunks, widths = [], []
    start = 0
    while start < len(lengths):
        stop, used = start + 1, lengths[start]
        while stop < len(lengths) and used + lengths[stop] <= budget and (size is None or stop - start < size):
            used += lengths[stop]
            stop += 1
        chunks.append((start, stop))
        end = max(last[start:stop])
        widths.append(end if 0 < end < width else None)  # (a chunk of padding only keeps its width)
        start = stop
    return chunks, widths


def _take(x: Any, start: int, stop: int, width: int | None, full: int) -> Any:
    """Rows ``start:stop`` of an input; of a Mapping's tensors that span the mask's ``full`` width, the
    first ``width`` columns; a Mapping's entries without a tensor as they are."""
    if not isinstance(x, Mapping):
        return microbatch.cut(x, start, stop)
    out: dict[Any, Any] = {}
    for key, value in x.items():
        if isinstance(value, Tensor):
            value = value[start:stop]
            if width is not None and value.ndim >= 2 and value.shape[1] == full:
                value = value[:, :width]
        elif _holds_tensor(value):
            value = microbatch.cut(value, start, stop)
        out[key] = value
    return type(x)(out)  # type: ignore[call-arg]


def _call_style(encoder: Callable[..., Any], part: Any, i: int) -> CallStyle:
    """How a chunk goes to its encoder: a Mapping as keyword arguments where the encoder takes them (a
    transformers model), else whole as its one argument (a SentenceTransformer's features dict)."""
    if not isinstance(part, Mapping):
        return "positional"
    target = getattr(encoder, "_orig_mod", encoder)  # (a compiled module: its forward's signature)
    target = target.forward if isinstance(target, nn.Module) else target
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # (no signature to read: as keyword arguments)
        return "keywords"
    if all(isinstance(key, str) for key in part) and _binds(signature, (), dict(part)):
        return "keywords"
    if _binds(signature, (part,), {}):
        return "whole"
    raise TypeError(
        f"encoder {i} takes {signature}, which fits neither way a Mapping input goes to an encoder: as keyword "
        f"arguments ({', '.join(map(repr, part))}: a transformers model's `input_ids=`, ...) or whole, as its one "
        "argument (a SentenceTransformer's features dict; the way before keyword arguments came in 0.3). Give an "
        "encoder that takes those keywords (`def encode(input_ids, attention_mask): ...`) or the dict alone "
        "(`def encode(batch): ...`)."
    )


def _binds(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _frozen(encoder: Callable[..., Any]) -> bool:
    """A module with parameters, none of which requires a gradient."""
    module = getattr(encoder, "_orig_mod", encoder)
    if not isinstance(module, nn.Module):
        return False
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


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


def _join(outs: list[tuple[Tensor, ...]], tower: Tower) -> list[Tensor]:
    """The chunks' representations, one tensor per output, after checking that they fit together."""
    where = f"encoder {tower.index}"
    if len({len(out) for out in outs}) > 1:
        raise ValueError(f"{where} returned different numbers of tensors for different chunks; return the same.")
    for out, (start, stop) in zip(outs, tower.chunks, strict=True):
        if any(t.shape[0] != stop - start for t in out):
            raise ValueError(
                f"{where} returned {[t.shape[0] for t in out]} rows for a chunk of {stop - start} samples; it must "
                "return one row per sample (dim 0)."
            )
    columns = list(zip(*outs, strict=True))
    for column in columns:
        shapes = sorted({tuple(t.shape[1:]) for t in column})
        if len(shapes) > 1:
            hint = (
                " `chunk_tokens` trims each chunk's padding columns, so an output per token changes width: pool it "
                "to a row per sample (`get_rep`), or chunk this encoder by `chunk_size` alone."
                if tower.trimmed
                else ""
            )
            raise ValueError(f"{where}'s representations differ in shape from chunk to chunk ({shapes}).{hint}")
    return [torch.cat(column) for column in columns]


def _leaf(rep: Tensor, grad: bool = True) -> Tensor:
    """A representation as a leaf of the loss; half precision goes to float32, so that the cached
    gradient keeps its precision (and a GradScaler's scale cannot overflow it)."""
    if not rep.is_floating_point():
        return rep
    leaf = rep.float() if rep.element_size() < 4 else rep.detach()
    return leaf.requires_grad_() if grad else leaf


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
            for module, name, buffer, copy_ in self._saved:
                if module._buffers.get(name) is not buffer:  # reassigned by the forward
                    module._buffers[name] = buffer
                buffer.copy_(copy_)
        self._saved = []


def backward_cached(
    encoders: Sequence[Callable[..., Any]],
    inputs: Sequence[Any],
    loss_fn: Callable[..., Tensor],
    chunk_size: int | Sequence[int | None] | None,
    loss_backward: Callable[[Tensor], None],
    reps_backward: Callable[[Sequence[Tensor], Sequence[Tensor]], None],
    *,
    gather: Gather | None = None,
    reduce: Reduce | None = None,
    world: int = 1,
    modules: Sequence[nn.Module] = (),
    get_rep: GetRep | Sequence[GetRep | None] | None = None,
    loss_chunk_size: int | None = None,
    chunk_tokens: int | Sequence[int | None] | None = None,
    no_grad: bool | Sequence[bool] = False,
) -> Tensor:
    """The cached backward of ``loss_fn(*[encoder(x) for encoder, x in zip(encoders, inputs)])``.

    ``plan`` then ``run``: each input chunked on its own (``chunk_size`` rows or ``chunk_tokens``
    tokens, one or one per encoder); see ``run`` for the rest. Returns the loss, detached.
    """
    towers = plan(
        encoders, inputs, loss_fn, chunk_size, get_rep=get_rep, chunk_tokens=chunk_tokens, no_grad=no_grad,
        loss_chunk_size=loss_chunk_size,
    )  # fmt: skip
    return run(
        towers, loss_fn, loss_backward, reps_backward, gather=gather, reduce=reduce, world=world, modules=modules,
        loss_chunk_size=None if loss_chunk_size is None else int(loss_chunk_size),
    )  # fmt: skip


def run(
    towers: Sequence[Tower],
    loss_fn: Callable[..., Tensor],
    loss_backward: Callable[[Tensor], None],
    reps_backward: Callable[[Sequence[Tensor], Sequence[Tensor]], None],
    *,
    gather: Gather | None = None,
    reduce: Reduce | None = None,
    world: int = 1,
    modules: Sequence[nn.Module] = (),
    loss_chunk_size: int | None = None,
    uncounted: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> Tensor:
    """The cached backward of planned towers.

    ``loss_backward(loss)`` runs the loss's backward (into the leaves), once, or once per block of
    ``loss_chunk_size`` rows of the first tower (``loss_fn(*reps, rows=...)``); ``reps_backward(reps,
    grads)`` a chunk's. ``gather`` puts all ``world`` ranks' representations into the loss and says
    which rows are this rank's. The whole loss on every rank: each rank's cached gradient is then
    multiplied by ``world``, so that the ranks' mean is the gathered loss's gradient. In blocks: each
    rank's blocks cover its own rows, each part multiplied by ``world`` (the ranks' mean of a loss
    parameter's gradient is then the whole loss's), and ``reduce`` sums the representations'
    gradients and the parts over ranks; the loss returned is then every rank's sum. The buffers of
    ``modules`` move once per sample; the RNG ends where the whole batch's forward and loss leave it; the
    graph-free pass of a tower that is replayed runs under ``uncounted()`` (``batchnorm="window"``: the
    replay's forward is the one that counts). Returns the loss, detached.

    The steps: the graph-free pass (``_first_pass``) -> the loss and its backward into the leaves (``_loss``) -> the
    leaves' gradients (summed over ranks, ``_sum_over_ranks``; this rank's rows, ``_own_rows``) -> each chunk
    replayed with its cached gradient (``_replay``).
    """
    local = gather is not None and loss_chunk_size is not None  # each rank scores its own rows
    if local and reduce is None:
        raise ValueError("`loss_chunk_size` with `gather` needs `reduce` (a sum over ranks).")
    states, leaves, offsets = _first_pass(towers, gather, modules, uncounted)
    total = _loss(loss_fn, leaves, loss_backward, offsets[0], towers[0].rows, loss_chunk_size, world if local else 1)
    after = _RNG()  # where the whole batch's forward and loss leave the generators
    grads: list[list[Tensor | None]] = [[t.grad if t.requires_grad else None for t in leaf] for leaf in leaves]
    if local:
        total = _sum_over_ranks(leaves, grads, total, reduce)  # type: ignore[arg-type]
    del leaves
    if gather is not None:  # (the replay needs this rank's rows only: the others' are let go)
        _own_rows(towers, grads, offsets)
    _replay(towers, states, grads, offsets, 1 if local else world, reps_backward)
    after.restore()
    return total


def _first_pass(
    towers: Sequence[Tower],
    gather: Gather | None,
    modules: Sequence[nn.Module],
    uncounted: Callable[[], contextlib.AbstractContextManager[None]],
) -> tuple[list[list[_RNG]], list[tuple[Tensor, ...]], list[int]]:
    """(1) Every tower's chunks without a graph: each replayed tower's RNG state per chunk, its representations as
    leaves of the loss (every rank's under ``gather``) and where this rank's rows start among them; the buffers of
    ``modules`` as they were before a replayed tower's pass (a frozen tower's pass is the one that counts: its
    writes stay)."""
    states: list[list[_RNG]] = [[] for _ in towers]
    leaves: list[tuple[Tensor, ...]] = []
    offsets: list[int] = []
    saved: _Buffers | None = None
    with torch.no_grad():
        for tower in towers:
            if tower.frozen and saved is not None:
                saved.restore()
                saved = None
            elif not tower.frozen and saved is None:
                saved = _Buffers(modules)
            reps = _encode_chunks(tower, states[tower.index], uncounted)
            offset = 0
            if gather is not None:
                reps, offset = gather(reps)
            offsets.append(offset)
            leaves.append(tuple(_leaf(r, grad=not tower.frozen) for r in reps))
            del reps
        if saved is not None:
            saved.restore()
    return states, leaves, offsets


def _encode_chunks(
    tower: Tower, states: list[_RNG], uncounted: Callable[[], contextlib.AbstractContextManager[None]]
) -> list[Tensor]:
    """A tower's representations, chunk by chunk (each chunk's RNG state kept in ``states`` where it is replayed),
    joined (the chunks' outputs let go: one copy of the representations is enough)."""
    outs = []
    for j in range(len(tower.chunks)):
        if not tower.frozen:
            states.append(_RNG())
        with contextlib.nullcontext() if tower.frozen else uncounted():
            outs.append(tower.encode(tower.part(j)))
    return _join(outs, tower)


def _loss(
    loss_fn: Callable[..., Tensor],
    leaves: list[tuple[Tensor, ...]],
    loss_backward: Callable[[Tensor], None],
    start: int,
    rows: int,
    size: int | None,
    factor: int,
) -> Tensor:
    """(2) The loss on every representation, back-propagated into the leaves: whole, or in blocks of ``size`` of the
    first tower's ``rows`` rows from ``start`` (``_loss_in_blocks``); detached (its graph held the leaves)."""
    args = [leaf[0] if len(leaf) == 1 else leaf for leaf in leaves]
    if size is not None:
        return _loss_in_blocks(loss_fn, args, loss_backward, start, rows, size, factor)
    whole = loss_fn(*args)
    loss_backward(whole)
    return whole.detach()


def _own_rows(towers: Sequence[Tower], grads: list[list[Tensor | None]], offsets: list[int]) -> None:
    """Under ``gather``: each tower's cached gradient cut to this rank's rows (copied, so that the other ranks' are
    let go), its offset then 0."""
    for tower in towers:
        i, start = tower.index, offsets[tower.index]
        grads[i] = [None if g is None else g[start : start + tower.rows].clone() for g in grads[i]]
        offsets[i] = 0


def _replay(
    towers: Sequence[Tower],
    states: list[list[_RNG]],
    grads: list[list[Tensor | None]],
    offsets: list[int],
    factor: int,
    reps_backward: Callable[[Sequence[Tensor], Sequence[Tensor]], None],
) -> None:
    """(3) Each chunk of every tower that needs a gradient again, with a graph and its RNG state replayed, its
    representations back-propagating their cached gradient (times ``factor``) through ``reps_backward``."""
    for tower in towers:
        if tower.frozen:
            continue
        i = tower.index
        for j, (start, stop) in enumerate(tower.chunks):
            rows = slice(offsets[i] + start, offsets[i] + stop)
            with states[i][j].replay():
                again = tower.encode(tower.part(j))
            pairs = [(r, g[rows]) for r, g in zip(again, grads[i], strict=True) if g is not None and r.requires_grad]
            del again
            if pairs:
                cached = [(g * factor if factor != 1 else g).to(r.dtype) for r, g in pairs]
                reps_backward([r for r, _ in pairs], cached)
                del pairs, cached


def _loss_in_blocks(
    loss_fn: Callable[..., Tensor],
    args: list[Any],
    loss_backward: Callable[[Tensor], None],
    start: int,
    rows: int,
    size: int,
    factor: int,
) -> Tensor:
    """``loss_fn(*args, rows=...)`` for consecutive blocks of ``size`` of the ``rows`` rows from
    ``start``, each part back-propagated (times ``factor``) before the next; their sum, detached."""
    total: Tensor | None = None
    for begin in range(start, start + rows, size):
        part = loss_fn(*args, rows=slice(begin, min(begin + size, start + rows)))
        loss_backward(part * factor if factor != 1 and isinstance(part, Tensor) else part)
        value = part.detach().reshape(())
        total = value if total is None else total + value
        del part
    assert total is not None  # (rows >= 1)
    return total


def _sum_over_ranks(
    leaves: list[tuple[Tensor, ...]], grads: list[list[Tensor | None]], total: Tensor, reduce: Reduce
) -> Tensor:
    """Every rank's gradient of the gathered representations summed over ranks (in ``grads``, in place;
    ``None`` where no rank has one), in one collective with each rank's loss (two where the loss's dtype is wider
    than every gradient's, as a float32 loss beside bfloat16 representations); returns the loss's sum."""
    slots = [(i, j) for i, leaf in enumerate(leaves) for j, t in enumerate(leaf) if t.requires_grad]
    tensors = [_or_zeros(grads[i][j], leaves[i][j]) for i, j in slots]
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors], total.dtype)  # (the loss's bits kept)
    present = torch.tensor([grads[i][j] is not None for i, j in slots], dtype=dtype, device=total.device)
    summed = reduce([*tensors, torch.cat([present, total.reshape(1).to(dtype)])])  # type: ignore[list-item]
    counts = summed[-1].tolist()  # (which gradients some rank has: every rank skips the same)
    for (i, j), grad, count in zip(slots, summed, counts, strict=False):
        grads[i][j] = grad if count else None
    return summed[-1][-1].to(total.dtype, copy=True)  # (a view would keep the whole flat buffer alive)


def _or_zeros(grad: Tensor | None, leaf: Tensor) -> Tensor:
    return torch.zeros_like(leaf) if grad is None else grad
