"""The reference's bf16 windows (``precision="bf16-true"``, issue 51): each window's gradient as the docs define it,
in plain torch, sharing no code with the package.

The model runs in bf16, as the precision makes it: the parameters rounded to bf16 once; the batch converted as
Lightning's ``bf16-true`` converts it (every float tensor to bf16) or, in the Fabric loop, the user's float32 data with
Fabric's module converting its input to bf16 and its output to float32. Each micro-batch's loss is the user's (the
runners' code, written again here) and its backward passes are the adapter's documented ones: one per loss, or one per
closure (``backward_each``), per head and one for the shared trunk with the heads' summed feature gradient
(``backward_heads``), per part (``backward_microbatches``, ``microbatch_size``), per Fabric pass. A pass has a weight: a
mean over items its count (``count(batch)``, ``items=``), a part of a batch (pieces, ``backward_microbatches``) its
share of the samples. Without ``grad_accum_dtype`` the weight is on the bf16 loss, in the order of the two roundings the
adapter makes: Lightning divides what ``training_step`` returns by the window's divisor and the callback weights a mean
by ``count(batch)`` on that; the mixin and Fabric weigh a mean by its count, then divide by the divisor; a part is
weighted by its share, then divided. The divisor is the window's k (1 for a ``Budget``'s windows). With
``grad_accum_dtype`` the loss reaches backward unweighted, divided by the power of two at or above k (``precision.md``:
a bf16 gradient scaled exactly, so the reference divides by 1 and leaves the whole division to the window's close), and
the weight multiplies the pass's gradient as it joins the window's sum (``Sums.harvest``: exactly, in float64; the
package, in float32). ``backward_heads``' task ``weights=`` stay on the loss (the runners pass none).

Then the window's gradient:

* ``grad_accum_dtype=None``: the passes' bf16 gradients summed in ``.grad`` by autograd, each add rounded to bf16
  (on each rank; then the package's all-reduce, a bf16 sum over ranks divided by their number), then "one in-place
  multiply of the gradient" by the window's correction (its divisor over what went in: ``normalisation.md``), in bf16.
  Each op is torch's own, in the order the docs give: the reference matches the package bit for bit.
* ``grad_accum_dtype="float32"``: the exact window gradient (the passes' bf16 gradients summed in float64 and divided
  by the window's micro-batches or items: float64's own error, below ``m * 2^-53`` of the terms' absolute sum, is
  inside the margin below) rounded to bf16 once (``round_bf16``: to nearest, ties to even). The package sums in
  float32 and normalises there, so it rounds to the same bf16 number unless the exact value lies within float32's
  error of a bf16 rounding boundary (half-way between two bf16 numbers). The criterion is exact where the maths
  allows it: for each element, with ``S`` the sum of the absolute values of its m terms over the normaliser,
  float32's recursive summation (m - 1 adds), the all-reduce's add and division, the scale's own rounding and the
  multiply stay within ``b = (m + ranks + 6) * 2^-24 * S`` of the exact value ``E`` (Higham's ``gamma_n`` bound,
  with margin); the package's bf16 value must be one that rounding some number in ``[E - b, E + b]`` gives, i.e. in
  ``[round_bf16(E - b), round_bf16(E + b)]``. Where that interval holds one bf16 number (almost every element), it is
  exact. Where it holds two, the package's choice is taken if it is one of them (counted in ``TIES``) so that the two
  runs go on from the same gradient; anything else differs from the reference's gradient at that step and is
  reported as a divergence (``differences``: each step's gradient, before clipping, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .configs import Config
from .model import errors, forward, guide_weights

BF16 = torch.bfloat16
U32 = 2.0**-24  # float32's unit roundoff
# with `grad_accum_dtype`: the elements landed, those that could round either way (and their windows), and those of
# them where the package took the other side
TIES: dict[str, int] = {"landed": 0, "windows": 0, "elements": 0, "taken": 0}


def round_bf16(x: Tensor) -> Tensor:
    """``x`` (float64) rounded to the nearest bf16 number, ties to even, as float64 (torch's own float64 -> bf16
    conversion goes through float32: two roundings). bf16 keeps 8 significant bits; no value here is near its
    subnormal range (2^-126) or its largest (3e38)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.round(mantissa * 256.0) / 256.0, exponent)  # (`round`: half to even)


def bounds(exact: Tensor, spread: Tensor, terms: int) -> tuple[Tensor, Tensor]:
    """The bf16 numbers the package may land on for an exact window gradient ``exact``, whose terms' absolute values,
    normalised, sum to ``spread`` over ``terms`` float32 adds (see the module's docstring): the least and the largest
    (float64)."""
    b = spread * ((terms + 6) * U32) * 1.0001 + exact.abs() * 2.0**-50
    return round_bf16(exact - b), round_bf16(exact + b)


# ---------------------------------------------------------------------------------------------------- the model's view
def converted(c: Config, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The micro-batch as the user's code sees it: Lightning's ``bf16-true`` converts every float tensor of the batch
    to bf16; the Fabric loop's data is float32 (Fabric converts only what enters the module)."""
    dtype = torch.float32 if c.adapter == "fabric" else BF16
    return {k: v.to(dtype) for k, v in batch.items()}


def model_input(c: Config, x: Tensor) -> Tensor:
    """A float64 input as it reaches the bf16 module (through the converted batch, and Fabric's module)."""
    return converted(c, {"x": x})["x"].to(BF16)


def outputs(c: Config, net: nn.Module, x: Tensor, piece: int | None = None) -> Tensor:
    """The net on a converted batch's ``x``: bf16 (Lightning), or float32 (Fabric's module converts its output to the
    default dtype, the user's float32)."""
    if c.adapter == "fabric":
        return net(x.to(BF16)).float()  # type: ignore[no-any-return]
    return forward(net, x, piece)


def count(batch: dict[str, Tensor]) -> Tensor:
    """``count(batch)``: the mask's items, in the converted batch's dtype."""
    return batch["mask"].sum()


def backward(net: nn.Module, loss: Tensor, nothing: bool, retain_graph: bool = False) -> None:
    """One pass; ``nothing``: it adds nothing (a mean over no items, NaN: the package replaces its gradient by zeros
    before it is accumulated), so each parameter it reaches keeps the gradient it had (zeros where it had none)."""
    if not nothing:
        loss.backward(retain_graph=retain_graph)
        return
    before = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    loss.backward(retain_graph=retain_graph)
    for p, had in zip(net.parameters(), before, strict=True):
        if p.grad is not None:
            p.grad = torch.zeros_like(p.grad) if had is None else had


# ---------------------------------------------------------------------------------------------------- the passes
Pass = Callable[[], None]  # runs one backward pass (its gradient accumulated into `.grad`)


#: with ``grad_accum_dtype``: the weight of the pass under way, which ``Sums.harvest`` puts on its gradients
WEIGHT: list[float] = []


def _on_gradient(weight: Tensor | float) -> None:
    """With ``grad_accum_dtype``: the pass under way is weighted by ``weight`` on its gradient, not its loss."""
    WEIGHT[:] = [float(weight)]


def _weighted(
    c: Config, loss: Tensor, weight: Tensor | int | None, divisor: int, divide_first: bool
) -> tuple[Tensor, bool]:
    """A pass's loss as it reaches backward, and whether it adds nothing: a mean weighted by its count (``weight``;
    0: nothing) and divided by the window's divisor, in the adapter's order: Lightning divides ``training_step``'s
    return first (``divide_first``), the mixin and Fabric weigh first. With ``grad_accum_dtype`` the weight goes on
    the pass's gradients (``_on_gradient``)."""
    nothing = weight is not None and not bool(weight != 0)
    if c.grad_accum_dtype is not None:
        if weight is not None:
            _on_gradient(weight)
        return loss / divisor, nothing
    if divide_first:
        loss = loss / divisor
        return (loss if weight is None else loss * weight), nothing
    if weight is not None:
        loss = loss * weight
    return loss / divisor, nothing


def _positions(batch: dict[str, Tensor]) -> int:
    return int(batch["x"].shape[0] * batch["x"].shape[1])


def callback_loss(c: Config, net: nn.Module, batch: dict[str, Tensor], piece: int | None = None) -> Tensor:
    """``training_step``'s loss (``package.Automatic``): a mean over positions, a sum over items, or their mean."""
    total = errors(outputs(c, net, batch["x"], piece), batch).sum()
    if c.normalize == "mean":
        return total / _positions(batch)
    return total / batch["mask"].sum() if c.reduction == "mean" else total


def piece_bounds(c: Config, samples: int, first_batch: int) -> list[tuple[int, int]] | None:
    """The callback's pieces of a loader batch of ``samples`` (``microbatch_size``), or ``None`` (whole, Lightning's
    own backward). ``"auto"`` halves the size (``max(1, attempt // 2)``) after each out-of-memory error of a piece of
    more than ``oom[0]`` samples; the size found holds for every later batch, and each batch is cut at it: the first
    batch (``first_batch`` samples) finds it."""
    size = c.microbatch_size
    if size is None:
        return None
    if size == "auto":
        found = None
        attempt = first_batch
        while c.oom is not None and attempt > c.oom[0]:
            found = max(1, attempt // 2)
            attempt = found
        size = found or samples
    elif samples <= size:
        return None
    return [(start, min(start + size, samples)) for start in range(0, samples, size)]


def _cut(batch: dict[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


def callback_passes(c: Config, net: nn.Module, batch: dict[str, Tensor], divisor: int, first: int) -> list[Pass]:
    """A loader batch's passes under ``AccumulationScheduler``: Lightning's backward of ``training_step``'s loss
    divided by the divisor (then weighted by ``count(batch)`` for a mean over items); with ``microbatch_size``, a
    pass per piece, weighted by its share of the samples (``"mean"``), or by ``count(piece)`` (a mean over items)."""
    b = converted(c, batch)
    mean_items = c.normalize == "items" and c.reduction == "mean"
    cuts = piece_bounds(c, len(b["x"]), first)
    if cuts is None:
        cuts = [(0, len(b["x"]))]
    samples = len(b["x"])
    passes: list[Pass] = []
    for start, stop in cuts:

        def run(start: int = start, stop: int = stop) -> None:
            part = b if (start, stop) == (0, samples) else _cut(b, start, stop)
            loss = callback_loss(c, net, part, None)
            weight = count(part) if mean_items else None
            if c.normalize == "mean" and (start, stop) != (0, samples):
                loss = _share(c, loss, (stop - start) / samples)
            backward(net, *_weighted(c, loss, weight, divisor, divide_first=True))

        passes.append(run)
    return passes


def _share(c: Config, loss: Tensor, share: float) -> Tensor:
    """A part's loss weighted by its share of the batch's samples: on the loss, or with ``grad_accum_dtype`` on the
    part's gradients (``_on_gradient``)."""
    if c.grad_accum_dtype is None:
        return loss * share
    _on_gradient(share)
    return loss


def _parts(c: Config, out: Tensor, batch: dict[str, Tensor], by_reduction: bool) -> list[Tensor]:
    """The mixin's two task losses of a micro-batch (its first two tokens' errors, the others')."""
    err = errors(out, batch)
    parts = [err[:, :2].sum(), err[:, 2:].sum()]
    if c.normalize == "mean":
        return [x / err.numel() for x in parts]
    if by_reduction:
        return [x / batch["mask"].sum() for x in parts]
    return parts


def mixin_passes(
    c: Config, net: nn.Module, batch: dict[str, Tensor], divisor: int, guide: nn.Module | None = None
) -> list[Pass]:
    """A micro-batch's passes under the mixin, mode by mode (``package.Manual._backward``): ``acc.backward`` (a mean
    weighted by ``items=`` or, under ``reduction="mean"``, by ``count(batch)``), ``backward_each`` (a pass per
    closure), ``backward_heads`` (a pass per head into a detached copy of the trunk's output, then the trunk's with
    the summed feature gradient), ``backward_microbatches`` (parts of 2 samples, each by its share or its count)."""
    b = converted(c, batch)
    by_reduction = c.normalize == "items" and c.reduction == "mean" and c.mean_by == "reduction"
    mean_items = c.normalize == "items" and c.reduction == "mean"
    n = count(b)
    passes: list[Pass] = []
    if c.mode in ("backward", "items_int"):

        def run() -> None:
            total = errors(outputs(c, net, b["x"], _piece(c)), b).sum()
            if c.normalize == "mean":
                loss, weight = total / _positions(b), None
            elif mean_items:
                weight = int(n) if c.mode == "items_int" and not by_reduction else n
                loss = total / n
            else:
                loss, weight = total, None
            backward(net, *_weighted(c, loss, weight, divisor, divide_first=False))

        passes.append(run)
    elif c.mode == "each":
        weight = n if by_reduction else None
        for i in (0, 1):

            def run(i: int = i) -> None:
                loss = _parts(c, outputs(c, net, b["x"]), b, by_reduction)[i]
                backward(net, *_weighted(c, loss, weight, divisor, divide_first=False))

            passes.append(run)
    elif c.mode == "heads":
        weight = n if by_reduction else None
        state: dict[str, Tensor] = {}

        def trunk() -> None:
            features = net[1](net[0](b["x"]))  # (`net[:2]`)
            state["features"], state["leaf"] = features, features.detach().requires_grad_(True)

        for i in (0, 1):

            def head(i: int = i) -> None:
                if i == 0:
                    trunk()
                loss = _parts(c, net[2](state["leaf"]), b, by_reduction)[i]
                backward(net, *_weighted(c, loss, weight, divisor, divide_first=False))

            passes.append(head)

        def trunk_backward() -> None:
            grad = state["leaf"].grad
            if grad is not None:
                if weight is not None and not bool(weight != 0):
                    grad = torch.zeros_like(grad)
                if weight is not None and c.grad_accum_dtype is not None:  # (the heads' passes were not weighted)
                    _on_gradient(weight)
                torch.autograd.backward(state["features"], grad_tensors=grad)
            state.clear()

        passes.append(trunk_backward)
    elif c.mode == "microbatches":
        samples = len(b["x"])
        whole = n if by_reduction else None
        for start in range(0, samples, 2):
            stop = min(start + 2, samples)

            def part_pass(start: int = start, stop: int = stop) -> None:
                part = b if (start, stop) == (0, samples) else _cut(b, start, stop)
                err = errors(outputs(c, net, part["x"], _piece(c)), part)
                if by_reduction:
                    loss = err.sum() / part["mask"].sum()
                elif c.normalize == "mean":
                    loss = err.sum() / err.numel()
                else:
                    loss = err.sum()
                if whole is not None:
                    weight = whole if samples <= 2 else count(part)
                    backward(net, *_weighted(c, loss, weight, divisor, divide_first=False))
                else:
                    if c.normalize == "mean" and samples > 2:
                        loss = _share(c, loss, (stop - start) / samples)
                    backward(net, loss / divisor, False)

            passes.append(part_pass)
    elif c.mode == "cached":
        passes = cached_passes(c, net, b, divisor, by_reduction, guide)
    else:
        raise AssertionError(f"the bf16 reference has no mixin mode {c.mode!r}")
    return passes


def _chunks(mask: Tensor | None, rows: int, size: int | None, budget: int | None) -> list[tuple[int, int, int | None]]:
    """A tower's chunks ``(start, stop, width)`` as ``cached.md`` defines them: ``size`` rows each; or, with a token
    budget, consecutive rows packed up to ``budget`` tokens of the mask (a longer row alone, at most ``size`` rows),
    each trimmed to its last real token (``width``; ``None``: nothing to trim, or a chunk of padding only)."""
    if budget is None:
        step = size or rows
        return [(s, min(s + step, rows), None) for s in range(0, rows, step)]
    assert mask is not None
    full = mask.shape[1]
    lengths = [int(n) for n in (mask != 0).sum(1)]
    ends = [max([j + 1 for j in range(full) if bool(mask[r, j] != 0)], default=0) for r in range(rows)]
    out: list[tuple[int, int, int | None]] = []
    start = 0
    while start < rows:
        stop, used = start + 1, lengths[start]
        while stop < rows and used + lengths[stop] <= budget and (size is None or stop - start < size):
            used += lengths[stop]
            stop += 1
        end = max(ends[start:stop])
        out.append((start, stop, end if 0 < end < full else None))
        start = stop
    return out


def cached_passes(
    c: Config, net: nn.Module, b: dict[str, Tensor], divisor: int, by_reduction: bool, guide: nn.Module | None
) -> list[Pass]:
    """``acc.backward_cached`` (``package.Manual``'s towers: each sample's first two tokens, then each other token as a
    sample of its own; a guide tower weighting each token's error, run once), as ``cached.md`` defines it: (1) each
    tower's chunks without a graph, their representations joined and, being bf16, made float32 leaves; (2) the loss
    on the leaves (in blocks of ``loss_chunk`` of the first tower's rows), each block back-propagated (weighted and
    divided as ``acc.backward``'s loss) into the leaves; (3) each chunk of each tower again with its graph,
    back-propagating its rows of the leaves' gradient, in the representation's dtype: a pass each."""
    x, mask, n = b["x"], b["mask"], len(b["x"])
    inputs = [x[:, :2], x[:, 2:].reshape(-1, 1, x.shape[-1])]
    masks = [mask[:, :2], mask[:, 2:].reshape(-1, 1)] if c.chunk_tokens is not None else [None, None]
    widths = [2, 1]
    budgets = c.chunk_tokens or [None, None]
    plans = [_chunks(masks[i], len(inputs[i]), c.chunks[i], budgets[i]) for i in (0, 1)]
    weight = count(b) if by_reduction else None
    nothing = weight is not None and not bool(weight != 0)
    state: dict[str, Any] = {}

    def encode(i: int, start: int, stop: int, width: int | None) -> Tensor:
        tokens = inputs[i][start:stop]
        out = net(tokens if width is None else tokens[:, :width])
        if out.shape[1] < widths[i]:  # (`package.Manual.encode`: the trimmed columns back as zeros)
            out = torch.cat([out, out.new_zeros(len(out), widths[i] - out.shape[1], out.shape[2])], dim=1)
        return out  # type: ignore[no-any-return]

    def loss_fn(a: Tensor, rest: Tensor, g: Tensor | None, rows: slice) -> Tensor:
        out = torch.cat([a, rest.reshape(n, -1, rest.shape[-1])], dim=1)
        err = errors(out[rows], {"y": b["y"][rows], "mask": mask[rows]})
        if g is not None:
            err = err * guide_weights(g)[rows]
        if by_reduction:
            return err.sum() / mask.sum()
        return err.sum() / (n * out.shape[1]) if c.normalize == "mean" else err.sum()

    def losses() -> None:
        with torch.no_grad():
            reps = [torch.cat([encode(i, s, e, w) for s, e, w in plans[i]]) for i in (0, 1)]
            g = None if guide is None else guide(x).float()
        leaves = [r.float().requires_grad_() for r in reps]
        blocks = [slice(None)] if c.loss_chunk is None else [slice(s, min(s + c.loss_chunk, n)) for s in
                                                             range(0, n, c.loss_chunk)]  # fmt: skip
        for rows in blocks:
            loss, _ = _weighted(c, loss_fn(leaves[0], leaves[1], g, rows), weight, divisor, divide_first=False)
            WEIGHT.clear()  # (the leaves are no parameters: the weight goes on each replay's gradients)
            loss.backward()
        state["grads"] = [leaf.grad for leaf in leaves]

    passes: list[Pass] = [losses]
    for i in (0, 1):
        for start, stop, width in plans[i]:

            def replay(i: int = i, start: int = start, stop: int = stop, width: int | None = width) -> None:
                grad = state["grads"][i]
                if grad is None:
                    return
                again = encode(i, start, stop, width)
                cached = torch.zeros_like(again) if nothing else grad[start:stop].to(again.dtype)
                if weight is not None and c.grad_accum_dtype is not None:
                    _on_gradient(weight)
                torch.autograd.backward([again], grad_tensors=[cached])

            passes.append(replay)
    return passes


def _piece(c: Config) -> int | None:
    """How many samples each forward takes where a BatchNorm layer sees it (the mixin's parts of 2)."""
    return 2 if c.batchnorm is not None and c.adapter == "mixin" and c.mode == "microbatches" else None


def fabric_passes(c: Config, net: nn.Module, batch: dict[str, Tensor], divisor: int) -> list[Pass]:
    """A micro-batch's passes in the Fabric loop (``fabric_runner.backward``): one, or two (its tokens' errors in two
    halves, the graph kept between), each a mean weighted by ``count(batch)`` under ``reduction="mean"``."""
    b = converted(c, batch)
    mean_items = c.normalize == "items" and c.reduction == "mean"
    weight = count(b) if mean_items else None
    state: dict[str, Tensor] = {}
    passes: list[Pass] = []
    for i in range(c.passes):

        def run(i: int = i) -> None:
            if i == 0:
                state["err"] = errors(outputs(c, net, b["x"]), b)
            err = state["err"]
            part = err if c.passes == 1 else (err[:, :2] if i == 0 else err[:, 2:])
            total = part.sum()
            if c.normalize == "mean":
                loss = total / err.numel()
            else:
                loss = total / b["mask"].sum() if c.reduction == "mean" else total
            backward(net, *_weighted(c, loss, weight, divisor, divide_first=False), retain_graph=i < c.passes - 1)
            if i == c.passes - 1:
                state.clear()

        passes.append(run)
    return passes


def passes_of(
    c: Config, net: nn.Module, batch: dict[str, Tensor], divisor: int, first: int, guide: nn.Module | None = None
) -> list[Pass]:
    """A micro-batch's backward passes in the configuration's adapter."""
    if c.adapter == "fabric":
        return fabric_passes(c, net, batch, divisor)
    if c.adapter == "mixin":
        return mixin_passes(c, net, batch, divisor, guide)
    return callback_passes(c, net, batch, divisor, first)


# ---------------------------------------------------------------------------------------------------- the window
class Landed:
    """A window's gradient as the reference lands it in ``.grad``; with ``grad_accum_dtype``, the bf16 numbers each
    element may be (``lo``, ``hi``: equal almost everywhere), by parameter."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[Tensor, Tensor]] = {}  # id(parameter) -> (lo, hi), bf16

    def take(self, params: Sequence[Tensor], package: Sequence[Tensor | None] | None) -> None:
        """Where an element may be either of two bf16 numbers, take the package's (``package``: its gradients of
        ``params`` at this step, before clipping) if it is one of them; the reference's otherwise."""
        for i, p in enumerate(params):
            if id(p) not in self.ranges or p.grad is None:
                continue
            lo, hi = self.ranges.pop(id(p))
            ambiguous = lo != hi
            if not bool(ambiguous.any()):
                continue
            TIES["elements"] += int(ambiguous.sum())
            got = None if package is None or i >= len(package) else package[i]
            if got is None or got.shape != p.shape:
                continue
            got = got.to(p.grad.dtype)
            legal = ambiguous & (got >= lo) & (got <= hi)
            TIES["taken"] += int((legal & (got != p.grad)).sum())
            p.grad = torch.where(legal, got, p.grad)


class Sums:
    """With ``grad_accum_dtype``: each parameter's exact window sum (float64), the sum of its terms' absolute values,
    and how many passes went in."""

    def __init__(self) -> None:
        self.sums: dict[int, Tensor] = {}
        self.spread: dict[int, Tensor] = {}
        self.terms = 0

    def harvest(self, params: Sequence[Tensor]) -> None:
        """After a pass: its gradients (``.grad``), times its weight (``WEIGHT``), into the sums; ``.grad`` let go."""
        self.terms += 1
        weight = WEIGHT.pop() if WEIGHT else 1.0
        for p in params:
            if p.grad is not None:
                g = p.grad.double() * weight
                self.sums[id(p)] = self.sums[id(p)] + g if id(p) in self.sums else g
                self.spread[id(p)] = self.spread[id(p)] + g.abs() if id(p) in self.spread else g.abs()
                p.grad = None

    def land(self, params: Sequence[Tensor], normaliser: float, world: int, landed: Landed) -> None:
        """The exact window gradient rounded to bf16 once into ``.grad``, and the bf16 numbers the package may land
        on (``bounds``: the passes' float32 adds, and the ranks')."""
        for p in params:
            if id(p) not in self.sums:
                continue
            exact = self.sums[id(p)] / normaliser
            lo, hi = bounds(exact, self.spread[id(p)] / normaliser, self.terms + world)
            p.grad = round_bf16(exact).to(p.dtype)
            landed.ranges[id(p)] = (lo.to(p.dtype), hi.to(p.dtype))
            TIES["landed"] += p.numel()
            if bool((lo != hi).any()):
                TIES["windows"] += 1


def window_gradient(
    c: Config,
    net: nn.Module,
    window: Sequence[dict[str, Tensor]],
    divisor: int,
    normaliser: float,
    first: int,
    join: tuple[int, Callable[[], None]] | None = None,
    guide: nn.Module | None = None,
) -> Landed:
    """The window's micro-batches (rank r's are ``window[r::c.world]``) back-propagated pass by pass, and the window's
    gradient landed in ``.grad`` (see the module's docstring). ``divisor``: what the package divides each loss by
    (the window's k, 1 with ``grad_accum_dtype`` or under a budget); ``normaliser``: what the window's summed gradient
    is divided by over all ranks (its micro-batches, or items); ``first``: the samples of the fit's first batch
    (``"auto"``'s size); ``join``: (the micro-batch at which, the callable that) the first layer joins the optimizer;
    ``guide``: the cached mode's guide tower."""
    params = [p for p in net.parameters()]
    landed = Landed()
    if c.grad_accum_dtype is not None:
        sums = Sums()
        for p in params:
            p.grad = None
        for i, batch in enumerate(window):
            if join is not None and join[0] == i:
                join[1]()
            for run in passes_of(c, net, batch, divisor, first, guide):
                run()
                sums.harvest(params)
        if join is not None and join[0] >= len(window):
            join[1]()
        sums.land(params, normaliser, c.world, landed)
        return landed
    # bf16 sums in `.grad`, rank by rank, then the all-reduce (a bf16 sum over ranks, divided by their number)
    per_rank: list[list[Tensor | None]] = []
    for r in range(c.world):
        for p in params:
            p.grad = None
        for i, batch in enumerate(window):
            if i % c.world != r:
                continue
            if join is not None and join[0] == i:
                join[1]()
            for run in passes_of(c, net, batch, divisor, first, guide):
                run()
        if join is not None and join[0] >= len(window):
            join[1]()
        per_rank.append([None if p.grad is None else p.grad.detach().clone() for p in params])
    for j, p in enumerate(params):
        grads = [g[j] for g in per_rank]
        present = [g for g in grads if g is not None]
        if not present:
            p.grad = None
            continue
        total = present[0] if len(grads) == 1 else None
        if total is None:  # (a rank without a gradient gives zeros)
            total = torch.zeros_like(present[0])
            for g in grads:
                total = total + (torch.zeros_like(present[0]) if g is None else g)
            total = total / c.world
        scale = divisor * c.world / normaliser
        if scale != 1.0:
            total = total.clone()
            total.mul_(scale)
        p.grad = total
    return landed


def each_windows(
    c: Config,
    net: nn.Module,
    opts: Sequence[torch.optim.Optimizer],
    window: Sequence[dict[str, Tensor]],
    divisor: int,
    normaliser: float,
    first: int,
) -> Iterator[Landed]:
    """A window per optimizer over the same micro-batches (the mixin's ``self.accumulate(batch, optimizer=i)`` in turn,
    each pass training that optimizer's parameters only, as ``toggle_optimizer`` leaves them): in each micro-batch
    optimizer 0's pass, then optimizer 1's. At the window's last one, each optimizer's window lands in ``.grad``, and
    the caller steps it (at each yield) before the next optimizer's last pass, which sees the new parameters."""
    groups = [[p for g in o.param_groups for p in g["params"]] for o in opts]
    every = list(net.parameters())
    trainable = [p.requires_grad for p in every]
    option = c.grad_accum_dtype is not None
    sums = [Sums() for _ in opts]
    for p in every:
        p.grad = None

    def passes(batch: dict[str, Tensor], i: int) -> None:
        mine = {id(p) for p in groups[i]}
        for p, t in zip(every, trainable, strict=True):
            p.requires_grad_(t and id(p) in mine)
        try:
            for run in passes_of(c, net, batch, divisor, first):
                run()
                if option:
                    sums[i].harvest(groups[i])
        finally:
            for p, t in zip(every, trainable, strict=True):
                p.requires_grad_(t)

    for batch in window[:-1]:
        for i in range(len(opts)):
            passes(batch, i)
    for i in range(len(opts)):
        passes(window[-1], i)
        landed = Landed()
        if option:
            sums[i].land(groups[i], normaliser, 1, landed)
        else:
            scale = divisor / normaliser
            for p in groups[i]:
                if p.grad is not None and scale != 1.0:
                    p.grad.mul_(scale)
        yield landed
