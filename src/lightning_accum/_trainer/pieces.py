"""``AccumulationScheduler(microbatch_size=)``: each loader batch's ``training_step`` run piece by piece.

While fitting, the callback routes the module's ``training_step`` here (``_seam.route_training_step``).
Each loader batch is cut along dim 0 into pieces of at most ``microbatch_size`` samples; for each
piece ``training_step`` runs (on the piece, with the loader batch's ``batch_idx``) and its loss is
back-propagated at once, so that only one piece's graph is alive at a time. Each piece is weighted
by its share of the batch:

* ``normalize="mean"``: its samples over the batch's (``training_step`` returns a mean over samples);
* ``"items"`` with ``reduction="sum"``: 1 (the pieces' sums add up to the batch's);
* ``"items"`` with ``reduction="mean"``: ``count(piece)``, as the callback weighs a whole batch by
  ``count(batch)``; a piece without items adds nothing (NaN included).

Each piece's backward is divided and weighted as Lightning and the callback treat a whole batch
(Lightning's division by ``accumulate_grad_batches``, AMP's loss scale, the callback's factor on the
loss's gradient) and goes through the precision plugin's ``backward``, so the pieces add up to the
batch's gradient. ``training_step`` then returns the batch's loss value as a leaf of its own, which
reaches no parameter: Lightning's backward, its hooks and ``outputs`` see one backward per loader
batch, and the schedule's ``k``, ``Progress`` and every report count loader batches. A batch that
fits one piece of an int size is not touched: ``training_step`` returns its own loss, and
Lightning's backward is its backward (``Pieces.whole``).

* **Sync.** Under DDP every backward of the fit runs without DDP's sync (``block_backward_sync``
  held from inside DDP's forward to the end of Lightning's backward) and the callback all-reduces
  the window's gradient once, at its last batch, so ranks may cut their batches differently; under
  FSDP2 the window's last piece syncs.
* **Zeroing.** Lightning zeroes the gradients *after* ``training_step`` on a window's first batch:
  there the pieces start from no gradient, and theirs is set aside across Lightning's zeroing (by
  reference, no copy) and put back before Lightning's backward.
* **"auto".** The size starts at the loader batch (or the last size that fitted) and halves on
  out-of-memory. A piece whose forward ran out of memory left no gradient: the batch continues from
  that piece at the smaller size (a piece's share does not depend on the size), from the generators'
  state the piece began with. One whose backward ran out left part of its gradient: the window is
  redone from its start (from the partial gradient a checkpoint gave it, if it was resumed inside),
  its earlier batches kept by reference and run again cut as they ran, from their generators' states
  (so each adds exactly what it added; at the size in force if that no longer fits), and the batch
  goes on at the smaller size. Never below one sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_accum._core import gradients, microbatch, sync
from lightning_accum._core.checkpoint import restore_partial
from lightning_accum._core.metrics import weigh
from lightning_accum._core.options import Count, MicrobatchSize
from lightning_accum._core.wide import WideSums
from lightning_accum._core.window import check_count

Grads = list[Tensor | None]


class _RNG:
    """The CPU generator's state and the current CUDA device's at one point, to run a forward again alike."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


@dataclasses.dataclass
class _Batch:
    """A loader batch being trained, or kept to redo its window."""

    batch: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    samples: int  # along dim 0
    items: int | Tensor  # count(batch), for reduction="mean" (then each piece weighs count(piece))
    final: bool  # the window closes after it
    redoing: bool  # its gradient is in the window already: its passes add nothing
    start: int = 0  # samples of it in the window's gradient already when it began (a resume inside it)
    done: int = 0  # samples back-propagated so far
    loss: Tensor | float = 0.0  # its loss so far, as `training_step` would return it for the whole batch
    summed: Tensor | float = 0.0  # reduction="mean": the pieces' losses times their item counts, summed
    whole: Tensor | None = None  # its loss, when it ran as one piece
    at_start: tuple[Tensor | float, Tensor | float] = (0.0, 0.0)  # (loss, summed) when it began
    rng: _RNG | None = None  # "auto": the generators at its start
    cuts: list[int] = dataclasses.field(default_factory=list)  # where its pieces so far ended
    counts: dict[tuple[int, int], int | Tensor] = dataclasses.field(default_factory=dict)  # count(piece) by bounds


@dataclasses.dataclass(frozen=True)
class Fit:
    """What a fit gives the pieces: the module and Lightning's parts their backward passes go through."""

    module: Any
    precision: Any  # the precision plugin: its `backward`
    scaler: Any  # AMP's GradScaler, or None
    strategy: Any
    plan: sync.SyncPlan
    optimizer: Any
    normalize: str
    mean_items: bool  # normalize="items" with reduction="mean"
    count: Count | None
    put_back: Callable[[], Grads | None]  # a resumed window's partial gradient into `.grad` (returned), once
    #: after each piece's backward (`batchnorm="window"`: its forwards' statistics kept with the finished pieces)
    piece_done: Callable[[], None] | None = None
    #: `batchnorm="window"`: around a loader batch of SWA's BatchNorm epoch (no backward), so that its pieces' forwards
    #: make one BatchNorm update with their pooled statistics, as the loader batch whole would
    one_update: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    #: `grad_accum_dtype`: where the narrow parameters' window sums are (cleared and restored with `.grad`; they take
    #: a piece's weight themselves, `WideSums.weighting`)
    wide: WideSums | None = None

    @property
    def params(self) -> list[Tensor]:
        """The optimizer's parameters as they are now: taken where they are used, not at train start (a param group
        added during the fit, e.g. by ``BaseFinetuning``, is part of every window from the one it joins)."""
        return gradients.optimizer_params(self.optimizer)


class Pieces:
    """The callback's split of each loader batch (``microbatch_size=``): its state across batches,
    windows and checkpoints, and ``step``, what Lightning calls as ``training_step``.

    Attributes:
        size: the ``microbatch_size`` given (an int, or ``"auto"``).
        found: ``"auto"``: the size out-of-memory errors left (``None``: the loader batch).
        used: the piece size the latest loader batch was cut with (reported as ``accum/microbatch_size``).
        in_backward: a piece's backward pass is under way (an exception there left part of its gradient).
        whole: the batch under way is one piece of an int ``microbatch_size``: ``training_step`` returned its
            own loss, and Lightning's backward and the callback treat it as without pieces.
        resume: ``(epoch, batch_idx, samples, loss, summed)``: the first ``samples`` of that batch are in
            the window's gradient but not counted (an exception cut the batch short between pieces): a
            resumed run trains the rest of it.

    Example:

        >>> pieces = Pieces("auto")
        >>> pieces.load_state_dict({"found": 4})
        >>> pieces.state_dict()
        {'found': 4, 'resume': None}
    """

    def __init__(self, size: MicrobatchSize, rule: microbatch.Split | None = None) -> None:
        self.size = size
        self.rule = rule  # `split=`: which leaves are cut (None: every tensor)
        self.found: int | None = None
        self.used: int | None = None
        self.in_backward = False
        self.whole = False
        self.resume: tuple[int, int, int, Tensor | float, Tensor | float] | None = None
        self._fit: Fit | None = None
        self._window: list[_Batch] = []  # "auto": the window's batches so far, to redo it after an OOM in backward
        self._base: Grads | None = None  # "auto": the partial gradient a resumed window started from
        self._next: tuple[Any, ...] | None = None  # what `begin` said about the coming batch
        self._forward_only = False
        self.batch: _Batch | None = None  # the batch under way
        self._aside: list[tuple[Tensor, Tensor | None]] | None = None  # (param, grad) set aside across the zeroing
        self._held = contextlib.ExitStack()  # DDP's sync off, till the end of Lightning's backward
        self._holding = False
        self._replaying = False
        self._as_ran = True  # a window is redone with each batch cut as it ran (else at the size in force)
        self._attempt = 0  # samples of the piece under way
        self._piece_rng: _RNG | None = None
        self._tried: list[int] = []
        self._divisor, self._factor = 1, 1.0  # the batch's: Lightning's division, the callback's factor

    # ------------------------------------------------------------------ the callback's calls
    def attach(self, fit: Fit) -> None:
        """At train start."""
        self._fit = fit
        self._window, self._base = [], None

    def rewiden(self, wide: WideSums | None) -> None:
        """``grad_accum_dtype``'s sums taken again (the narrow parameters changed as a window opened)."""
        if self._fit is not None:
            self._fit = dataclasses.replace(self._fit, wide=wide)

    def detach(self) -> None:
        self.release()
        self._fit, self.batch, self._next = None, None, None
        self._window, self._base = [], None

    def fresh_fit(self) -> None:
        """A fit not resumed from a checkpoint: nothing of an earlier fit's batches or window is continued."""
        self.resume = None
        self.forget_window()

    def forget_window(self) -> None:
        """A window was stepped (or opened): forget its batches."""
        self._window, self._base, self._as_ran = [], None, True

    def begin(
        self,
        where: tuple[int, int],
        items: int | Tensor,
        *,
        final: bool,
        zeroes_after: bool,
        redoing: bool,
        divisor: int,
        factor: float,
    ) -> None:
        """The coming batch (epoch, index): its item count, whether the window closes after it, whether
        Lightning zeroes the gradients after its ``training_step``, whether it adds nothing, and how its
        loss is treated (Lightning's division, the callback's factor on the loss's gradient)."""
        self._forward_only, self.batch, self.in_backward, self.whole = False, None, False, False
        items = check_count(items)  # (refused before any piece's gradient goes in, as without pieces)
        self._next = (where, items, final, zeroes_after, redoing, divisor, factor)

    def begin_forward_only(self) -> None:
        """The coming batch has no backward (``StochasticWeightAveraging``'s BatchNorm epoch)."""
        self._forward_only, self.batch, self._next, self.in_backward, self.whole = True, None, None, False, False

    def length(self, batch: Any) -> int:
        """The loader batch's samples: the length of what is cut (``split=``), or an error naming where it cannot be."""
        return _length(batch, self.rule)

    def batch_done(self) -> None:
        self.batch, self._next = None, None

    def release(self) -> None:
        """End what the batch holds (DDP's sync off)."""
        if self._holding:
            self._held.close()
            self._holding = False

    def restore_aside(self) -> None:
        """Put back the gradient set aside across Lightning's zeroing (after it)."""
        if self._aside is not None:
            for p, g in self._aside:
                p.grad = g
        self._aside = None

    def cut_short(self, where: tuple[int, int], single: bool) -> bool:
        """After an exception before the batch was counted: whether part of it is in the window's gradient,
        which a checkpoint cannot take out (``True``: the window must be left out). On one process the
        part is kept instead (``resume``), and a resumed run trains the rest of the batch."""
        b = self.batch
        self.batch = None
        if b is None or b.done == b.start or self.in_backward:
            return False
        if not single:
            return True
        done = b.loss if b.whole is None else b.whole
        loss, summed = (v.detach().cpu() if isinstance(v, Tensor) else v for v in (done, b.summed))
        self.resume = (*where, b.done, loss, summed)
        return False

    # ------------------------------------------------------------------ what Lightning calls
    def step(self, original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
        """``training_step`` of the loader ``batch``: each piece's forward and backward, then the batch's
        loss value (on a graph that reaches no parameter) for Lightning's own backward."""
        fit = self._fit
        assert fit is not None, "the callback attaches the pieces at train start"
        samples = _length(batch, self.rule)
        if fit.plan.family == "ddp":
            self._block_sync(fit)
        if self._forward_only or self._next is None:  # (no backward: the pieces' forward, and the batch's loss)
            return self._forward(original, fit, batch, args, kwargs, samples)
        where, items, final, zeroes_after, redoing, self._divisor, self._factor = self._next
        if self.size != "auto" and samples <= self.size and self.resume is None:
            self.whole, self.used = True, samples  # one piece: as without pieces (Lightning's backward is its own)
            return original(batch, *args, **kwargs)
        b = _Batch(batch, args, kwargs, samples, items, final=final, redoing=redoing)
        self._begin(fit, b, where, zeroes_after)
        out = None  # (every sample of the batch in the gradient before a resume: nothing left to run)
        if b.done < b.samples:
            out = self._train(original, b, backward=True)
            if out is None:
                return None
        if zeroes_after:
            self._set_aside(fit)
        if self.size == "auto" and not b.redoing:
            self._window.append(b)
        # the batch's loss value for Lightning: a leaf of its own, so its backward reaches no parameter
        return _with_loss(out, self._value(b).detach().requires_grad_())

    def _block_sync(self, fit: Fit) -> None:
        """Under DDP, inside its forward (it reads the flag after ``training_step`` returns): no gradient sync in any
        backward of the batch (the callback all-reduces the window's gradient at its end)."""
        self.release()
        self._held.enter_context(fit.strategy.block_backward_sync())
        self._holding = True

    def _forward(
        self, original: Callable[..., Any], fit: Fit, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        samples: int,
    ) -> Any:  # fmt: skip
        """A loader batch without backward (SWA's BatchNorm epoch, a batch Lightning runs forward only): its pieces'
        forwards (under ``batchnorm="window"`` SWA's make one BatchNorm update, as the loader batch whole), and the
        batch's loss value."""
        items = _count(fit.count, batch) if fit.mean_items else samples
        b = _Batch(batch, args, kwargs, samples, items, final=False, redoing=True)
        pooled = fit.one_update if fit.one_update is not None and self._forward_only else contextlib.nullcontext
        with pooled():
            out = self._train(original, b, backward=False)
        return out if out is None else _with_loss(out, self._value(b).detach())

    def _set_aside(self, fit: Fit) -> None:
        """Lightning zeroes after this step (a window's first batch): the pieces' gradient set aside across it (by
        reference), put back before Lightning's backward."""
        self._aside = [(p, p.grad) for p in fit.params]
        for p, _ in self._aside:
            p.grad = None

    def _begin(self, fit: Fit, b: _Batch, where: tuple[int, int], zeroes_after: bool) -> None:
        """Before a loader batch's pieces: the gradient they start from (none where Lightning zeroes after this step,
        a resumed window's partial one put back), a checkpoint's part of the batch, and the generators' state for
        ``"auto"``'s redo."""
        if zeroes_after:  # Lightning zeroes after this step: the window starts from no gradient
            for p in fit.params:
                p.grad = None
            if fit.wide is not None:
                fit.wide.clear(fit.params)
        base = fit.put_back()
        if base is not None:
            self._base = base
        if self.resume is not None:
            self._resume(b, where)
        if self.size == "auto":
            b.rng = _RNG()
        self.batch = b

    def _resume(self, b: _Batch, where: tuple[int, int]) -> None:
        assert self.resume is not None
        epoch, index, done, loss, summed = self.resume
        self.resume = None
        if (epoch, index) != where:
            warnings.warn(
                f"A checkpoint held the first {done} samples of batch {index} of epoch {epoch} (an exception cut it "
                f"short between micro-batches), but the resumed run trains batch {where[1]} of epoch {where[0]} "
                "first: the loader must resume at the batches Lightning processed.",
                stacklevel=2,
            )
            return
        b.start = b.done = done
        b.loss, b.summed = loss, summed

    def _value(self, b: _Batch) -> Tensor:
        """The batch's loss as ``training_step`` would return it for the whole batch."""
        fit = self._fit
        assert fit is not None
        if b.whole is not None:
            return b.whole
        value = b.summed / b.items if fit.mean_items else b.loss
        if not isinstance(value, Tensor):  # (every sample was in before a resume)
            value = torch.tensor(value)
        return value.to(fit.strategy.root_device)

    # ------------------------------------------------------------------ pieces, and the out-of-memory back-off
    def _train(self, original: Callable[..., Any], b: _Batch, backward: bool) -> Any:
        b.at_start = (b.loss, b.summed)
        redo = False
        while True:
            try:
                if redo:
                    self._replay(original)
                    redo = False
                    if b.rng is not None:
                        b.rng.restore()
                return self._pieces(original, b, backward)
            except Exception as error:
                if self.size != "auto" or not microbatch.is_oom(error):
                    raise
                attempt, where = self._attempt, "backward" if self.in_backward or self._replaying else "forward"
                if attempt <= 1:
                    tried = ", ".join(str(s) for s in self._tried or [attempt])
                    raise RuntimeError(
                        f"`microbatch_size='auto'`: out of memory in a {where} pass with micro-batches of a single "
                        f"sample (sizes tried: {tried}): one sample does not fit. Reduce the model or the sequence "
                        "length, or use a strategy that shards the model (FSDP2)."
                    ) from error
            # (outside the `except` block, so that the error's frames, and the failed piece's tensors, are freed)
            larger = self._replaying and self._as_ran and attempt > self._size(b)
            self.in_backward = self._replaying = False
            if larger:  # a batch replayed as it ran no longer fits: the window again, every batch at the size in force
                self._as_ran = False
                self._clear(b)
                redo = True
            else:
                redo = self._back_off(attempt, where, b)

    def _back_off(self, attempt: int, where: str, b: _Batch) -> bool:
        """After an out-of-memory error in a piece of ``attempt`` samples: halve; whether the window is redone."""
        fit = self._fit
        assert fit is not None
        if not self._tried:
            self._tried.append(self.found or b.samples)
        self.found = max(1, attempt // 2)
        self._tried.append(self.found)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        warnings.warn(
            f"`microbatch_size='auto'`: out of memory in a {where} pass of a micro-batch of {attempt} samples; "
            f"continuing with micro-batches of {self.found} samples"
            + (", the accumulation window redone from its start." if where == "backward" else "."),
            stacklevel=2,
        )
        if where == "forward":  # nothing of the piece reached the gradient: go on from it
            if self._piece_rng is not None:
                self._piece_rng.restore()
            return False
        self._clear(b)  # part of a backward pass is in the gradient: redo the window
        return True

    def _clear(self, b: _Batch) -> None:
        """The window's gradient as it was at its start (none, or a resumed window's partial one), ``b`` not begun."""
        fit = self._fit
        assert fit is not None
        for p in fit.params:
            p.grad = None
        if fit.wide is not None:
            fit.wide.clear(fit.params)
        if self._base is not None:
            restore_partial(fit.params, self._base, fit.wide)
        b.done, (b.loss, b.summed), b.whole, b.cuts = b.start, b.at_start, None, []

    def _replay(self, original: Callable[..., Any]) -> None:
        """The window's earlier batches again, each from its generators' state at its start and cut as it ran
        (so that each adds what it added before, random draws included), or at the size in force once that
        ran out of memory."""
        self._replaying = True
        for past in self._window:
            past.done, cuts = past.start, past.cuts if self._as_ran else None
            past.cuts = []
            if past.rng is not None:
                past.rng.restore()
            self._pieces(original, past, backward=True, cuts=cuts)
        self._replaying = False

    def _size(self, b: _Batch) -> int:
        if self.size == "auto":
            return self.found or b.samples
        return self.size

    def _pieces(self, original: Callable[..., Any], b: _Batch, backward: bool, cuts: list[int] | None = None) -> Any:
        """Forward and backward of each piece of ``b`` not done yet (ending at ``cuts``, or of the size in force);
        the last piece's output (``None`` if the first returned ``None``: Lightning then skips the batch)."""
        out: Any = None
        size = self._size(b)
        bounds = list(zip([b.done, *cuts[:-1]], cuts, strict=True)) if cuts else _bounds(b.done, b.samples, size)
        if self._fit is not None and self._fit.mean_items:
            self._count_pieces(b, bounds)  # (every piece before `training_step` runs on any: it may change them)
        for start, stop in bounds:
            whole = start == 0 and stop == b.samples
            # ("auto": the whole batch as a copy of its containers, so that a `training_step` that changes it leaves
            # the batch intact for a redo at a smaller size)
            piece = b.batch if whole and self.size != "auto" else microbatch.cut(b.batch, start, stop, self.rule)
            self._attempt = stop - start
            if self.size == "auto":
                self._piece_rng = _RNG()
            out = original(piece, *b.args, **b.kwargs)
            loss = _loss_of(out)
            if loss is None:
                if start == 0:
                    return None
                raise RuntimeError(
                    f"`training_step` returned None for samples {start}:{stop} of a loader batch split by "
                    "`microbatch_size`, after earlier micro-batches of it were back-propagated: return a loss for "
                    "every micro-batch (a zero loss adds nothing), or None for the batch's first one to skip it."
                )
            self._add(loss, (start, stop), b, backward, final=b.final and stop == b.samples)
            b.done = stop
            b.cuts.append(stop)
            if stop < b.samples:
                del out, loss, piece  # (one piece's tensors alive at a time)
        self.used = min(size, b.samples)
        return out

    def _count_pieces(self, b: _Batch, bounds: Sequence[tuple[int, int]]) -> None:
        """``count(piece)`` of each piece of ``b`` not counted yet (``reduction="mean"``), all before ``training_step``
        runs on any of them (it may change its batch: ``labels = batch.pop("labels")``), each checked."""
        fit = self._fit
        assert fit is not None
        for start, stop in bounds:
            if (start, stop) not in b.counts and not (start == 0 and stop == b.samples):
                b.counts[start, stop] = _count(fit.count, microbatch.cut(b.batch, start, stop, self.rule))

    def _add(self, loss: Tensor, bounds: tuple[int, int], b: _Batch, backward: bool, final: bool) -> None:
        """A piece's loss into the batch's, and its backward pass (weighted as its share of the batch)."""
        fit = self._fit
        assert fit is not None
        n = bounds[1] - bounds[0]
        whole = n == b.samples
        factor: float | Tensor = self._factor if backward else 1.0
        nothing: bool | Tensor = b.redoing
        share = 1.0  # (`grad_accum_dtype`: a mean piece's share goes on its gradients as they are taken, not its loss)
        if fit.mean_items:
            items = b.items if whole else b.counts[bounds]
            factor = factor * items
            if not b.redoing:
                nothing = gradients.no_items(items)
            b.summed = b.summed + weigh(loss.detach(), items)
            value = loss
        elif whole:
            value = loss
        elif fit.normalize != "mean":
            value = loss
            b.loss = b.loss + value.detach()
        else:
            share = n / b.samples
            value = loss if fit.wide is not None else loss * share
            b.loss = b.loss + loss.detach() * share
        if whole:
            b.whole = loss.detach()
        if not backward:
            return
        # as Lightning divides the loss `training_step` returns (x / 1 is x, and so is its gradient)
        scaled = value / self._divisor if self._divisor != 1 else value
        if fit.scaler is not None:
            scaled = fit.scaler.scale(scaled)
        if fit.wide is None:
            sync.scale_backward(scaled, factor)
            weighting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            weighting = fit.wide.weighting(factor * share)
        handles = [] if nothing is False else gradients.add_nothing_if(fit.params, nothing)
        self.in_backward = True
        try:
            with _no_autocast(scaled), self._sync(final), weighting:
                fit.precision.backward(scaled, fit.module, fit.optimizer)
        finally:
            for handle in handles:
                handle.remove()
        self.in_backward = False
        if fit.piece_done is not None:
            fit.piece_done()

    def _sync(self, final: bool) -> contextlib.AbstractContextManager[None]:
        """FSDP2 (and FSDP): skip the gradient sync unless the window ends with this piece (DDP's is off for the
        whole batch)."""
        fit = self._fit
        assert fit is not None
        if fit.plan.sharded:
            return sync.skip_sync(fit.plan, fit.strategy, final)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"found": self.found, "resume": None if self.resume is None else list(self.resume)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        found = state.get("found")
        self.found = None if found is None else int(found)
        resume = state.get("resume")
        self.resume = None if resume is None else (int(resume[0]), int(resume[1]), int(resume[2]), *resume[3:5])


def _length(batch: Any, rule: microbatch.Split | None = None) -> int:
    """The batch's length along dim 0 (the same for every tensor cut), or an error naming where it cannot be cut."""
    sizes: set[int] = set()
    if rule is None and _lengths(batch, sizes) and len(sizes) == 1:  # (the common case, without the bookkeeping)
        return sizes.pop()
    try:
        return microbatch.batch_length(batch, rule)
    except ValueError as error:
        raise ValueError(
            f"`AccumulationScheduler(microbatch_size=...)` cuts each loader batch along dim 0, but this one cannot be "
            f"cut: {error} Give batches of tensors (dicts, lists, tuples, dataclasses or a `BatchEncoding` of them, "
            "all the same length along dim 0; `None` leaves are kept), e.g. tokenise text in the dataset or the "
            "collate function, or leave `microbatch_size` out."
        ) from error


def _lengths(obj: Any, sizes: set[int]) -> bool:
    """Add each tensor's dim 0 in ``obj`` to ``sizes``; ``False`` at anything that cannot be cut."""
    if isinstance(obj, Tensor):
        if not obj.ndim:
            return False
        sizes.add(obj.shape[0])
        return True
    if obj is None:
        return True
    if isinstance(obj, Mapping):
        return all(_lengths(v, sizes) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_lengths(v, sizes) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return all(_lengths(getattr(obj, f.name), sizes) for f in dataclasses.fields(obj))
    return False


def _loss_of(out: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, a Mapping with ``"loss"``, or ``None``)."""
    if out is None or isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
        return out["loss"]  # type: ignore[no-any-return]
    raise TypeError(
        f"`training_step` returned {type(out).__name__}; with `microbatch_size` it must return a loss tensor, a "
        "dict with a 'loss' tensor, or None."
    )


def _with_loss(out: Any, loss: Tensor) -> Any:
    """``out`` with its loss replaced (a dict keeps the last piece's other entries)."""
    return {**out, "loss": loss} if isinstance(out, Mapping) else loss


def _count(count: Count | None, piece: Any) -> int | Tensor:
    assert count is not None, "reduction='mean' comes with `count`"
    return check_count(count(piece), "`count(piece)` of a micro-batch cut by `microbatch_size`")


def _bounds(done: int, samples: int, size: int) -> list[tuple[int, int]]:
    """The pieces ``(start, stop)`` of the samples from ``done`` on, ``size`` at a time (the last may be shorter)."""
    return [(start, min(start + size, samples)) for start in range(done, samples, size)]


def _no_autocast(loss: Tensor) -> contextlib.AbstractContextManager[Any]:
    """A backward pass inside ``training_step`` (where Lightning's precision plugin autocasts) runs as
    Lightning's own backward does: without autocast (an op that ran in float32 under a disabled autocast
    in the forward would otherwise run its backward in the autocast dtype)."""
    kind = loss.device.type
    if torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()
