"""``Accumulator``: the backward passes of one micro-batch into the open window.

What ``with self.accumulate(batch) as acc`` gives. Each pass is divided by the window's
divisor and runs under the driver's sync plan; the accumulator counts its passes and the
items they declare, which the driver adds to the window when the block exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_accum import multitask
from lightning_accum._core import cached, collectives, gradients, microbatch
from lightning_accum._core.metrics import weigh
from lightning_accum._core.microbatch import AutoSize
from lightning_accum._core.options import check_flag
from lightning_accum._trainer.block import Block


class Accumulator:
    """What ``with self.accumulate(batch) as acc`` gives: backward passes into the open window.

    Made by the mixin for each block; you never construct one (it is exported for type annotations). For a
    Fabric loop, the accumulator to construct is ``FabricAccumulator``.

    Attributes:
        k: micro-batches of the window (under a ``Budget``, its cap: ``max_k``, or ``OPEN_ENDED``; ``last`` says
            whether this micro-batch closes it).
        index: this micro-batch's position in the window (0-based).
        last: whether the window closes after this micro-batch (``k`` reached, a ``Budget`` reached, or epoch
            end; under a ``Budget`` on several ranks, reading it inside the block waits for the micro-batch's count
            over ranks, which the block otherwise reads at its end). Not whether it steps: a window of no items
            (``normalize="items"``) closes unstepped, and a window whose epoch ends on batches that run no block of it
            is closed at the epoch's end, with no block to see it. For one LR-scheduler step per optimizer step, step
            it in the model's ``on_window_end``.
    """

    def __init__(self, block: Block, batch: Any, auto: AutoSize) -> None:
        self._block, self._batch, self._auto_size = block, batch, auto
        self.k = block.window.k
        self.index = block.window.microbatches
        self._open = True
        self._auto = 0  # `backward_microbatches(size="auto")` calls of this block

    @property
    def last(self) -> bool:
        """Whether this micro-batch closes its window (under a ``Budget`` on several ranks, reading it waits for the
        micro-batch's count over the ranks, sent as the block opened).

        Example:

            with self.accumulate(batch) as acc:
                acc.backward(loss)
                if acc.last:
                    self.log("window_closes", 1.0)
        """
        return self._block.last

    def _close(self) -> None:
        """The block exited: no more passes into this micro-batch (called by the mixin)."""
        self._open = False

    def _check_declared(self, items: Any, call: str) -> None:
        """Refuse ``items=`` where it weighs nothing (``normalize="mean"``) or is no count."""
        if items is None:
            return
        if self._block.windows.config.normalize != "items":
            raise ValueError(
                f"`{call}` weights the loss by its item count, which needs `normalize='items'`; with "
                "`normalize='mean'` every micro-batch counts once: leave `items` out."
            )
        _check_items(items)

    def _check_open(self, auto: bool = False) -> None:
        """The block is open, and its passes do not mix ``backward_microbatches(size="auto")`` with other
        passes in one window: after an out-of-memory error only the former can be redone."""
        if not self._open:
            raise RuntimeError(
                "`acc.backward*` was called outside its `with self.accumulate(batch) as acc:` block; "
                "call it inside the block, which closes the window on exit."
            )
        replayed = self._auto_size.passes(self._block.key) + self._auto
        others = self._block.window.microbatches + (self._block.passes > 0) - replayed
        if (auto and others > 0) or (not auto and replayed > 0):
            raise ValueError(
                '`acc.backward_microbatches(loss_fn, size="auto")` cannot share a window with other backward passes '
                "(`acc.backward`, `backward_each`, `backward_heads`, `backward_cached`, or a fixed `size`): on "
                "out-of-memory it redoes the window from its start, and only its own passes can be redone. Use it "
                "for every pass of the window, or give `size` a number."
            )

    def _backward(self, loss: Tensor, nothing: bool | Tensor = False, weight: float | Tensor | None = None) -> None:
        """``manual_backward(loss * weight / divisor)`` with gradient sync skipped as the plan says (``weight``: a mean
        loss's item count or a part's share, ``None`` for none; under ``grad_accum_dtype`` it goes on the gradients
        as they are taken, in the wide dtype, not on the loss: ``_weighting``)."""
        block = self._block
        weighed = loss if weight is None else weigh(loss, weight)
        block.record_loss(weighed)
        if block.windows.wide_sums() is None or weight is None:
            block.backward(weighed / block.window.divisor, nothing=nothing)
            return
        with self._weighting(weight):
            block.backward(loss / block.window.divisor, nothing=nothing)

    def _weighting(self, weight: float | Tensor | None) -> contextlib.AbstractContextManager[None]:
        """Under ``grad_accum_dtype``: the passes inside have their gradients weighted by ``weight`` as they are
        taken (``WideSums.weighting``); else (or for no weight) nothing."""
        wide = self._block.windows.wide_sums()
        return contextlib.nullcontext() if wide is None or weight is None else wide.weighting(weight)

    def backward(self, loss: Tensor, *, items: int | Tensor | None = None) -> None:
        """Back-propagate one loss into the window.

        With ``normalize="items"``, ``loss`` is a sum over the micro-batch's items
        (``reduction="sum"``), or a mean over them (``reduction="mean"``), then weighted by
        ``count(batch)``: the micro-batch's items, counted once however many passes it makes. Or pass a
        mean loss with ``items=n`` (either reduction): it is weighted by ``n``, which this pass adds to
        the micro-batch's items. A mean over no items (NaN) adds nothing.

        Example:

            # configure_accumulation(..., normalize="items", count=causal_lm_tokens, reduction="mean")
            with self.accumulate(batch) as acc:
                acc.backward(self.model(**batch).loss)  # a token mean, weighted by the batch's tokens
        """
        self._check_open()
        loss = multitask.check_loss(loss, "the loss passed to `acc.backward`")
        self._check_declared(items, "acc.backward(loss, items=n)")
        self._weighted(loss, self._block.weight(items))

    def _weighted(self, loss: Tensor, items: int | Tensor | None) -> None:
        """A pass of a loss weighted by ``items`` (a mean over them; ``None``: as it is): a pass of no items
        counts, and adds nothing to any gradient (for a tensor count, decided on the device)."""
        self._backward(loss, False if items is None else gradients.no_items(items), items)

    def _passes(self) -> tuple[Callable[[Tensor], None], bool | Tensor, int | Tensor | None]:
        """A call of several passes without ``items=`` (``backward_each``, ``backward_heads``): each pass's backward,
        weighted by ``count(batch)`` under ``reduction="mean"``, whether they add nothing (no items), and the
        weight (``None``: none)."""
        weight = self._block.weight(None)
        empty = False if weight is None else gradients.no_items(weight)
        return (lambda loss: self._weighted(loss, weight)), empty, weight

    def backward_each(
        self,
        closures: Sequence[Callable[[], Tensor]],
        weights: Sequence[float] | None = None,
        *,
        grad_norms: bool = False,
        names: Sequence[str] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run each closure's forward and backward in turn: one task graph alive at a time.

        Returns the detached per-task losses, and with ``grad_norms=True`` also the L2 norm of
        each task's weighted gradient (one gradient copy per task). Each task's window loss is
        logged as ``accum/loss/<name>`` (``names``, default ``task0``, ``task1``, ...).
        """
        self._check_open()
        params = self._block.windows.params() if grad_norms else None
        backward, empty, weight = self._passes()
        if self._block.windows.wide_sums() is None:
            losses, norms = multitask.backward_each(backward, closures, weights, grad_norms_of=params)
        else:  # (`grad_accum_dtype`: each task's weight, with the count, on its gradients as they are taken)

            def weighed(loss: Tensor, w: float) -> None:
                both = w if weight is None else weight if w == 1.0 else weight * w
                plain = not isinstance(both, Tensor) and both == 1.0
                self._backward(loss, empty, None if plain else both)

            losses, norms = multitask.backward_each(weighed, closures, weights, grad_norms_of=params, weighs=True)
        self._record_tasks(losses, names)
        return (losses, norms) if grad_norms else losses  # type: ignore[return-value]

    def _record_tasks(self, losses: Tensor, names: Sequence[str] | None) -> None:
        if isinstance(names, str) or (names is not None and not all(isinstance(n, str) for n in names)):
            raise TypeError(f"`names` must be a list of strings, one per task (e.g. ['lm', 'cls']); got {names!r}.")
        names = [f"task{i}" for i in range(len(losses))] if names is None else list(names)
        if len(names) != len(losses):
            raise ValueError(f"`names` has {len(names)} entries for {len(losses)} tasks; give one name per task.")
        for name, loss in zip(names, losses, strict=True):
            self._block.record_loss(loss, f"loss/{name}")

    def backward_microbatches(
        self,
        loss_fn: Callable[[Any], Tensor],
        size: int | Literal["auto"] = "auto",
        *,
        split: microbatch.Split | None = None,
    ) -> Tensor:
        """Split this micro-batch's ``batch`` along dim 0 and back-propagate ``loss_fn(part)`` for
        each part, weighted so that the result equals the whole batch's (sample-weighted for
        ``"mean"``; for ``"items"``, plain sums, or under ``reduction="mean"`` each part's mean weighted
        by ``count(part)``: ``count`` must add up over the parts, as a token count does). Returns the
        detached per-part losses.

        ``size="auto"`` starts with the whole batch and, on CUDA out-of-memory, frees the
        window's gradient, halves the size, and redoes the window from its first micro-batch
        (its batches are kept by reference): no sample is lost or counted twice. The size is kept
        for later batches and agreed on by all ranks (their minimum) at each window's end.

        ``split(path, leaf) -> bool`` says which leaves of the batch are cut (``True``) and which every part
        gets whole (``False``: a per-class weight, a shared prompt); by default every tensor is cut.
        """
        self._check_open(auto=size == "auto")
        rule = microbatch.check_split(split, "`backward_microbatches`")
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"`size` must be an int >= 1 (samples per part) or 'auto'; got {size!r}.")
        microbatch.batch_length(self._batch, rule)  # (a batch that cannot be cut: refused before any part runs)
        auto = self._auto_size
        whole = self._block.weight(None)  # (under reduction="mean", `count(batch)` weighs the batch as one part)
        if size != "auto":
            return self._run_parts(self._batch, loss_fn, size, whole, rule)
        self._auto += 1
        redo: list[tuple[Any, Callable[[Any], Tensor], Any]] = []
        while True:
            size = auto.size_for(self._batch, rule)
            try:
                for past_batch, past_fn, (past_whole, past_rule) in redo:
                    self._run_parts(past_batch, past_fn, size, past_whole, past_rule)
                losses = self._run_parts(self._batch, loss_fn, size, whole, rule)
                break
            except Exception as error:
                if not microbatch.is_oom(error):
                    raise
                if size == 1:
                    raise RuntimeError(
                        "Out of memory with micro-batches of a single sample: one sample does not fit. Reduce the "
                        "model or sequence size, or use a strategy that shards it (FSDP)."
                    ) from error
            # outside the `except` block, so that the error's frames (and their tensors) are freed
            for p in self._block.params():
                p.grad = None
            if self._block.engine.wide is not None:  # (`grad_accum_dtype`'s sums with it)
                self._block.engine.wide.clear(self._block.params())
            self._block.engine.metrics.clear()  # (the window is redone from its start)
            if self._block.engine.batchnorm is not None:  # (and its BatchNorm statistics with it)
                self._block.engine.batchnorm.discard()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            auto.halve(size)
            redo = auto.replay(self._block.key)
        auto.remember(self._block.key, self._batch, loss_fn, (whole, rule))
        return losses

    def _run_parts(
        self,
        batch: Any,
        loss_fn: Callable[[Any], Tensor],
        size: int,
        whole: int | Tensor | None,
        rule: microbatch.Split | None = None,
    ) -> Tensor:
        """``loss_fn`` of each part of ``batch``, back-propagated as its share of the batch (``whole``: what the
        batch's own loss is weighted by, ``count(batch)`` for a mean over its items, or ``None``; ``rule``: which
        leaves are cut)."""
        n = microbatch.batch_length(batch, rule)
        mean = self._block.windows.config.normalize == "mean"
        parts = microbatch.split(batch, size, rule)
        weights = None
        if whole is not None and size < n:  # every part counted before `loss_fn` runs on any (it may change them)
            weights = [self._block.part_weight(part) for part in parts]
        losses = []
        for i, part in enumerate(parts):
            loss = multitask.check_loss(loss_fn(part), "the loss returned by `loss_fn`")
            if whole is not None:  # a mean over the part's items: weighted by them (the whole batch: as counted)
                self._weighted(loss, whole if weights is None else weights[i])
            else:
                self._backward(loss, weight=microbatch.batch_length(part, rule) / n if mean and size < n else None)
            losses.append(loss.detach())
        return torch.stack(losses)

    def backward_cached(
        self,
        encoders: Sequence[Callable[..., Any]],
        inputs: Sequence[Any],
        loss_fn: Callable[..., Tensor],
        *,
        chunk_size: int | Sequence[int | None] | None = None,
        gather: bool = False,
        items: int | Tensor | None = None,
        get_rep: cached.GetRep | Sequence[cached.GetRep | None] | None = None,
        loss_chunk_size: int | None = None,
        chunk_tokens: int | Sequence[int | None] | None = None,
        no_grad: bool | Sequence[bool] = False,
    ) -> Tensor:
        """Back-propagate a loss that couples the whole batch, one chunk's graph at a time (GradCache).

        ``loss_fn(*[encoder(x) for encoder, x in zip(encoders, inputs)])`` on the whole batch, each
        input split along dim 0 into chunks of ``chunk_size`` samples (one int, or one per encoder):
        the gradient equals the whole batch's, dropout included (each chunk's RNG state is replayed),
        for a peak of one chunk's graph plus the representations. Towers may hold different numbers
        of samples (B queries against B x (1 + n) passages with n hard negatives each).

        - ``loss_chunk_size=m``: the loss runs in blocks of m rows of the first input,
          ``loss_fn(*reps, rows=slice(i, i + m))`` returning the part of the loss those rows make (the
          parts sum to the whole loss), each back-propagated before the next: one block of the score
          matrix alive (m x B(1 + n)) instead of all of it. With ``gather=True`` each rank scores only
          its own rows against every rank's, and the gradient of every rank's representations comes
          back to their owners (summed over ranks).
        - ``chunk_tokens=N`` (one, or one per encoder): chunks packed up to N tokens, counted by the
          input's ``attention_mask`` (a longer sample alone; at most ``chunk_size`` samples where both
          are given), each chunk's trailing padding columns trimmed.
        - A Mapping input (a dict, a ``BatchEncoding``) is passed as keyword arguments where the
          encoder takes them (a transformers model), else whole (a SentenceTransformer's features
          dict); entries without a tensor (``"modality": "text"``) go to every chunk as they are.
          ``get_rep`` picks the representation from the encoder's output; without it, an output
          mapping's ``"sentence_embedding"`` (a SentenceTransformer's) is taken.
        - A tower that needs no gradient (a module whose parameters all have ``requires_grad=False``,
          or ``no_grad=True``, one or one per encoder) runs once, without a graph, and is not replayed.
        - ``gather=True`` puts every rank's representations into the loss (in-batch negatives from
          all ranks): 2 ranks of batch B equal one process of 2B, also with different batch sizes.

        The call is one micro-batch of the window; ``items`` weights the loss as in ``backward``, and so
        does ``count(batch)`` under ``reduction="mean"`` without ``items`` (with ``gather=True``, by all
        ranks' count, as one process with every rank's batch). Buffers a
        forward writes (BatchNorm statistics, ...) move once per sample; the RNG ends where the whole
        batch's forward and loss leave it. Returns the loss, detached (with ``gather=True`` and
        ``loss_chunk_size``, the whole gathered loss: every rank's parts summed).

        Example:

            def info_nce(q, d, rows):  # the rows' part of the mean cross-entropy
                scores = F.normalize(q[rows], dim=1) @ F.normalize(d, dim=1).T / 0.05
                labels = torch.arange(rows.start, rows.stop, device=q.device)
                return F.cross_entropy(scores, labels, reduction="sum") / len(q)

            with self.accumulate(batch) as acc:
                acc.backward_cached(
                    [self.bert, self.bert], [batch["queries"], batch["passages"]], info_nce,
                    chunk_size=32, loss_chunk_size=64, gather=True,
                    get_rep=lambda out: out.last_hidden_state[:, 0],
                )
        """
        self._check_open()
        check_flag("gather", gather)
        self._check_declared(items, "acc.backward_cached(..., items=n)")
        towers = cached.plan(
            encoders, inputs, loss_fn, chunk_size, get_rep=get_rep, chunk_tokens=chunk_tokens, no_grad=no_grad,
            loss_chunk_size=loss_chunk_size,
        )  # fmt: skip
        block = self._block
        strategy = block.strategy
        world = collectives.world_size(strategy) if gather else 1
        weight: int | float | Tensor | None = block.weight(items)
        if weight is not None and world > 1:  # every rank's rows are in the loss: weighted by every rank's count
            weight = collectives.sum_over_ranks(strategy, [weight])[0][0] / world
        empty = False if weight is None else gradients.no_items(weight)

        wide = block.windows.wide_sums() is not None  # (the weight then goes on each pass's gradients: `_weighting`)

        def loss_backward(loss: Tensor) -> None:
            loss = multitask.check_loss(loss, "the loss returned by `loss_fn`")
            if weight is None:
                block.backward(loss / block.window.divisor)
            elif empty is True:  # (a mean over no items: it adds nothing)
                block.backward(loss, nothing=True)
            elif wide:
                with self._weighting(weight):
                    block.backward(loss / block.window.divisor, nothing=empty)
            else:
                block.backward(weigh(loss, weight) / block.window.divisor, nothing=empty)

        def reps_backward(reps: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
            # (FSDP, FSDP2: every chunk of the window's last batch syncs, since each module
            # reduce-scatters in its own backward and two towers end at different chunks)
            with self._weighting(weight if wide else None):
                block.trunk_backward(reps, gradients.zero_where(grads, empty))  # (no items: may be NaN, adds nothing)

        def gather_rows(reps: Sequence[Tensor]) -> tuple[list[Tensor], int]:
            return collectives.gather_rows(strategy, reps)

        loss = cached.run(
            towers,
            loss_fn,
            loss_backward,
            reps_backward,
            gather=gather_rows if world > 1 else None,
            reduce=collectives.sum_tensors,
            world=world,
            modules=[block.module],
            loss_chunk_size=None if loss_chunk_size is None else int(loss_chunk_size),
            uncounted=block.uncounted,
        )
        block.record_loss(loss if weight is None else weigh(loss, weight))
        return loss

    def backward_heads(
        self,
        features: Tensor,
        heads: Sequence[Callable[[Tensor], Tensor]],
        weights: Sequence[float] | None = None,
        *,
        names: Sequence[str] | None = None,
    ) -> Tensor:
        """Shared trunk: each head back-propagates into a detached copy of ``features`` in turn,
        then the trunk back-propagates once with the summed feature gradient. Peak memory is the
        trunk's graph plus the largest head's. Returns the detached per-head losses; each head's
        window loss is logged as ``accum/loss/<name>`` (``names``, default ``task0``, ...)."""
        self._check_open()
        backward, empty, weight = self._passes()

        def trunk_backward(features: Tensor, grad: Tensor) -> None:  # (no items: the heads' NaN adds nothing)
            with self._weighting(weight):  # (`grad_accum_dtype`: the heads' passes were not weighted)
                self._block.trunk_backward(features, gradients.zero_where([grad], empty)[0])

        losses = multitask.backward_heads(backward, features, heads, weights, trunk_backward=trunk_backward)
        self._record_tasks(losses, names)
        return losses


def _check_items(items: object) -> None:
    """``items=`` of ``acc.backward``: an int >= 0 or a one-element tensor (checked on the host at the window's end)."""
    if isinstance(items, Tensor):
        if items.numel() == 1:
            return
        what = f"a tensor of shape {tuple(items.shape)}"
    elif isinstance(items, int) and not isinstance(items, bool) and items >= 0:
        return
    else:
        what = repr(items)
    raise ValueError(
        f"`acc.backward(loss, items=...)` got {what}; `items` must be the micro-batch's number of items (tokens, ...): "
        "an int >= 0 or a one-element tensor."
    )
