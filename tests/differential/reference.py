"""The float64 reference: a plain PyTorch loop that forms each window by hand, as the docs say.

It imports neither Lightning nor ``lightning_accum``: every schedule, LR shape and policy is
written out here from its definition. A window opens with the ``k`` its schedule gives for the
progress so far (closed windows only) and holds the next ``k`` batches, cut at the epoch's end;
its gradient is the mean of its micro-batch gradients (``"mean"``) or the sum over its items
divided by their count (``"items"``; a micro-batch without items adds nothing, a window
without any is not stepped and changes nothing, decay included). Then decay, clipping, the LR
(scheduler x ``lr_scaling`` x ``lr_schedule``), the step, step-interval schedulers; at each
epoch's end the probe, ``EarlyStopping`` and epoch-interval schedulers (as Lightning orders them);
``StochasticWeightAveraging`` as Lightning's callback does it (its ``SWALR`` from torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR

from . import bf16_reference
from .configs import Config
from .model import Data, batch_probe, forward, make_net, micro_loss, probe_loss
from .noise_reference import NoiseReference


@dataclasses.dataclass
class Result:
    params: list[Tensor]
    global_step: int
    lrs: list[list[float]]  # per optimizer step (each optimizer's, in order): each group's LR as the step used it
    adam: list[dict[str, Tensor]] | None  # per optimizer and parameter: exp_avg, exp_avg_sq, step
    ema: list[Tensor] | None = None  # the "ema" callback's average of the parameters after each step
    buffers: list[Tensor] | None = None  # with a BatchNorm layer: its running mean, variance, `num_batches_tracked`
    # under bf16 (`Config.bf16`): per optimizer step (as `lrs`), the gradient of each of its parameters (in its param
    # groups' order; None where it has none) as the step got it, before clipping
    grads: list[list[Tensor | None]] | None = None


EMA = 0.6  # the "ema" callback's decay


def schedule_k(spec: dict[str, Any], p: dict[str, float]) -> int:
    family = spec["family"]
    if family == "constant":
        return int(spec["k"])
    if family == "piecewise":
        k = 1
        for at, value in sorted(spec["milestones"]):
            if p[spec["unit"]] >= at:
                k = value
        return int(k)
    if family == "ramp":
        start, end = spec["start"], spec["end"]
        t = p[spec["unit"]] / spec["over"]
        if t >= 1:
            return int(end)
        raw = start + (end - start) * t
        return int(min(max(math.floor(raw + 1e-9), min(start, end)), max(start, end)))
    fn = spec["fn"]
    if fn == "cycle3":
        return 1 + int(p["step"]) % 3
    if fn == "epoch_up":
        return 1 + min(int(p["epoch"]), 3)
    return 2 if p["samples"] < 30 else 3  # "samples_tier"


def budget_span(c: Config, data: Any, ahead: list[int], p: dict[str, float]) -> tuple[list[int], bool, int]:
    """A ``Budget``'s window from the batches ``ahead`` (their indices in the epoch): up to the first at which the
    count over ranks (samples, or the mask's tokens) reaches the budget read now, at most ``max_k`` of them; whether
    it closed so (else the epoch ended first), and the budget."""
    spec = c.schedule
    n = spec["n"] if isinstance(spec["n"], int) else schedule_k(spec["n"], p)
    cap = spec.get("max_k") or math.inf
    seen, span = 0.0, []
    for j in ahead:
        span.append(j)
        for r in range(c.world):
            b = data.batch(j * c.world + r)
            seen += len(b["x"]) if spec["unit"] == "samples" else float(b["mask"].sum())
        if seen >= n or len(span) >= cap:
            return span, True, n
    return span, False, n


def warmup_cosine(spec: dict[str, Any], p: dict[str, float]) -> float:
    x, warmup, total, final = float(p[spec["unit"]]), spec["warmup"], spec["total"], spec["final"]
    if x < warmup:
        return x / warmup
    t = min(1.0, (x - warmup) / (total - warmup))
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))


def make_optimizer(c: Config, params: Any) -> torch.optim.Optimizer:
    if c.optimizer == "adam":
        return torch.optim.Adam(params, lr=c.lr)
    return torch.optim.SGD(params, lr=c.lr, momentum=0.9 if c.optimizer == "momentum" else 0.0)


def make_optimizers(c: Config, net: nn.Module) -> list[torch.optim.Optimizer]:
    """One optimizer; or two (the mixin): the first layers' and the last's, and with ``shared`` the first
    holds the last layer's bias too."""
    if c.unfreeze is not None and c.optimizers == 1:  # (the first layer joins as a param group of its own at
        return [make_optimizer(c, [*net[1].parameters(), *net[2].parameters()])]  # `c.unfreeze`)
    if c.optimizers == 1:
        return [make_optimizer(c, net.parameters())]
    # (`net[1]`: the BatchNorm layer's weight and bias where the net has one, with the first layer's; with `unfreeze`
    # the first layer joins the first optimizer at `c.unfreeze`)
    first, last = [*([] if c.unfreeze else net[0].parameters()), *net[1].parameters()], list(net[2].parameters())
    return [make_optimizer(c, first + (last[1:] if c.shared else [])), make_optimizer(c, last)]


def optimizer_state(c: Config, opts: list[torch.optim.Optimizer]) -> list[dict[str, Tensor]] | None:
    """Adam's state per optimizer and parameter (``None`` for SGD)."""
    if c.optimizer != "adam":
        return None
    return [
        {key: torch.as_tensor(v, dtype=torch.float64) for key, v in opt.state[prm].items()}
        for opt in opts
        for group in opt.param_groups
        for prm in group["params"]
        if prm in opt.state
    ]


def make_scheduler(c: Config, opt: torch.optim.Optimizer) -> Any:
    if c.scheduler is None:
        return None
    if c.scheduler["kind"] == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.0)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=c.scheduler["step_size"], gamma=0.5)


def _terms(
    c: Config,
    net: nn.Module,
    batches: list[dict[str, Tensor]],
    tokens: float,
    size: int,
    guide: nn.Module | None = None,
) -> list[Tensor]:
    """Each micro-batch's part of the loss of a window of ``size`` and ``tokens`` items: its mean over the window
    (``"mean"``), or its sum over the window's items (``"items"``; zero from a micro-batch without items); each
    token's error times the cached mode's ``guide`` weight where there is one."""
    terms = []
    for b in batches:
        total, n_items, positions = micro_loss(net, b, guide, piece(c))
        if c.normalize == "items":  # (a micro-batch without items still ran its backward: the parameters it
            # reaches get a zero gradient, not none, as in a plain loop; Adam then counts a step for a param group
            # that joined at it)
            terms.append(total / tokens if n_items > 0 else total * 0.0)
        else:
            terms.append(total / positions / size)
    return terms


def piece(c: Config) -> int | None:
    """How many samples each forward takes, where the package cuts a batch in pieces and a BatchNorm layer sees
    it (the callback's ``microbatch_size``, the mixin's ``backward_microbatches`` in parts of 2); else the batch."""
    if c.batchnorm is None:
        return None
    if c.adapter == "callback" and isinstance(c.microbatch_size, int):
        return c.microbatch_size
    return 2 if c.adapter == "mixin" and c.mode == "microbatches" else None


class BatchNormStatistics:
    """The BatchNorm layer's running statistics as ``c.batchnorm`` defines them. Under ``"micro-batch"`` torch's own
    update at every training forward (what a plain loop does). Under ``"window"`` none of those: the buffers are put
    back after the window's forwards, then updated once, ``running = (1 - m) * running + m * stat`` with the mean
    and unbiased variance of everything the layer was given in the window, taken at once from those inputs joined
    (``m``: the momentum, or ``1 / num_batches_tracked`` with ``None``), ``num_batches_tracked`` + 1."""

    def __init__(self, c: Config, net: nn.Module) -> None:
        self.mode = c.batchnorm
        self.layers = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.inputs: list[Tensor] | None = None
        for layer in self.layers:
            layer.register_forward_hook(self._record)

    def _record(self, layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        if self.inputs is not None and layer.training:
            x = args[0].detach()
            self.inputs.append(x.transpose(0, 1).reshape(x.shape[1], -1))  # (channels, samples x positions)

    @contextlib.contextmanager
    def _untracked(self) -> Iterator[None]:
        """Forwards that leave the buffers alone: normalised by their own statistics, as in training, without
        torch's update (a buffer written in place would also break the backward, which saved it)."""
        for layer in self.layers:
            layer.track_running_stats = False
        try:
            yield
        finally:
            for layer in self.layers:
                layer.track_running_stats = True

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """The forwards of a window that is stepped."""
        if self.mode != "window" or not self.layers:
            yield
            return
        (layer,) = self.layers
        self.inputs = []
        try:
            with self._untracked():
                yield
            inputs = self.inputs
        finally:
            self.inputs = None
        if not inputs:  # (no forward: nothing to pool)
            return
        x = torch.cat(inputs, dim=1)
        assert layer.running_mean is not None and layer.running_var is not None
        assert layer.num_batches_tracked is not None
        with torch.no_grad():
            layer.num_batches_tracked.add_(1)
            m = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
            layer.running_mean.copy_((1 - m) * layer.running_mean + m * x.mean(dim=1))
            layer.running_var.copy_((1 - m) * layer.running_var + m * x.var(dim=1))

    @contextlib.contextmanager
    def untouched(self) -> Iterator[None]:
        """Forwards that do not count (the reference's own, to measure the noise)."""
        with self._untracked():
            yield

    def unstepped(
        self, c: Config, net: nn.Module, batches: list[dict[str, Tensor]], skipped: list[Tensor] | None = None
    ) -> None:
        """A window of no items (or of no backward pass: ``skipped``, the forwards of batches that ran no backward)
        is not stepped, but its forwards ran: under ``"micro-batch"`` they updated the buffers, under ``"window"``
        the window's statistics are those of its samples all the same (as the package does: the statistics follow
        the samples the layer saw, not the step)."""
        with torch.no_grad(), self.window():
            for b in batches:
                forward(net, bf16_reference.model_input(c, b["x"]) if c.bf16 else b["x"], piece(c))
            for x in skipped or []:
                net(bf16_reference.model_input(c, x) if c.bf16 else x)

    def result(self) -> list[Tensor] | None:
        return [b.detach().clone() for layer in self.layers for b in layer.buffers()] if self.mode else None


def _mixin_span(c: Config, ahead: list[int], k: int) -> tuple[list[int], bool]:
    """The mixin's window of ``k`` from the batches ``ahead`` where skipped batches run a block without a backward
    pass (``skip_forward``): such a block is none of the window's k micro-batches, but one at its k-th place closes it
    (as ``acc.last`` said as it opened: the window then holds k - 1); whether it closed so (else the epoch ended)."""
    span, counted = [], 0
    for j in ahead:
        span.append(j)
        if counted + 1 >= k:
            return span, True
        counted += j not in c.skip
    return span, False


def _skipped(c: Config, data: Data, span: list[int]) -> list[Tensor]:
    """The inputs of the forwards that the skipped batches of a window (``span``) ran without a backward pass
    (``skip_forward``): the callback's first piece of each (``microbatch_size``: the piece that returned ``None``
    skips the batch), the mixin's whole batch; under ``batchnorm="window"`` they count in the window's statistics."""
    if not c.skip_forward:
        return []
    size = c.microbatch_size if c.adapter == "callback" and isinstance(c.microbatch_size, int) else None
    xs = [data.batch(j * c.world + r)["x"] for j in span if j in c.skip for r in range(c.world)]
    return [x if size is None else x[:size] for x in xs]


def _step(
    c: Config, opt: torch.optim.Optimizer, factor: float, lrs: list[list[float]],
    grads: list[list[Tensor | None]] | None = None,
) -> None:
    """Clip the optimizer's own gradient, step it with its LRs times ``factor`` (for this step only); ``grads``: where
    its parameters' gradients before clipping go."""
    params = [prm for g in opt.param_groups for prm in g["params"]]
    if grads is not None:
        grads.append([None if prm.grad is None else prm.grad.detach().clone() for prm in params])
    if c.clip is not None:
        if c.clip[1] == "norm":
            nn.utils.clip_grad_norm_(params, c.clip[0])
        else:
            nn.utils.clip_grad_value_(params, c.clip[0])
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = g["lr"] * factor
    lrs.append([g["lr"] for g in opt.param_groups])
    opt.step()
    for g, lr in zip(opt.param_groups, saved, strict=True):
        g["lr"] = lr


def _join(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The first layer unfrozen and added to the optimizer as a param group of its own (its defaults)."""
    net[0].requires_grad_(True)
    opt.add_param_group({"params": list(net[0].parameters())})


def _ema(c: Config, net: nn.Module, ema: list[Tensor] | None) -> list[Tensor] | None:
    """The "ema" callback's average after a window's step."""
    if "ema" not in c.callbacks:
        return ema
    now = [prm.detach().clone() for prm in net.parameters()]
    return now if ema is None else [EMA * a + (1 - EMA) * b for a, b in zip(ema, now, strict=True)]


def _each(
    c: Config, net: nn.Module, opts: list[torch.optim.Optimizer], window: list[dict[str, Tensor]], tokens: float,
    factor: float, lrs: list[list[float]],
) -> Iterator[Tensor]:
    """Windows of their own for each optimizer, over the same micro-batches, each pass back-propagated into its
    optimizer's parameters only: in each batch optimizer 0's pass, then optimizer 1's; at the window's last batch
    optimizer 0 steps before optimizer 1's last pass (which sees the new parameters). Yields each window's loss
    after its step."""
    groups = [[prm for g in opt.param_groups for prm in g["params"]] for opt in opts]
    before = _terms(c, net, window[:-1], tokens, len(window))  # (the parameters stay put until the last batch)
    early = sum(before, torch.zeros((), dtype=torch.float64))
    early_grads = [
        torch.autograd.grad(early, group, retain_graph=True, allow_unused=True) if before else [None] * len(group)
        for group in groups
    ]
    for opt, group, grads in zip(opts, groups, early_grads, strict=True):
        last = sum(_terms(c, net, window[-1:], tokens, len(window)), torch.zeros((), dtype=torch.float64))
        own = torch.autograd.grad(last, group, allow_unused=True) if last.requires_grad else [None] * len(group)
        for prm, a, b in zip(group, grads, own, strict=True):
            parts = [x for x in (a, b) if x is not None]
            prm.grad = sum(parts[1:], parts[0].clone()) if parts else torch.zeros_like(prm)
        _step(c, opt, factor, lrs)
        yield (early + last).detach()


def _each_bf16(
    c: Config,
    net: nn.Module,
    opts: list[torch.optim.Optimizer],
    window: list[dict[str, Tensor]],
    divisor: int,
    normaliser: float,
    first: int,
    factor: float,
    lrs: list[list[float]],
    grads: list[list[Tensor | None]],
    taken: list[list[Tensor | None]] | None,
) -> Iterator[Tensor]:
    """``_each`` under bf16: each optimizer's window landed (``bf16_reference.each_windows``) and stepped in turn;
    yields a stand-in loss (no monitor watches the window loss under bf16)."""
    for opt, landed in zip(opts, bf16_reference.each_windows(c, net, opts, window, divisor, normaliser, first),
                           strict=True):  # fmt: skip
        mine = [prm for g in opt.param_groups for prm in g["params"]]
        landed.take(mine, taken[len(grads)] if taken is not None and len(grads) < len(taken) else None)
        _step(c, opt, factor, lrs, grads)
        yield torch.zeros((), dtype=torch.float64)


def run(c: Config, package: Result | None = None) -> Result:
    """The reference's result on ``c``; under bf16 with ``grad_accum_dtype``, ``package``'s gradients settle the
    elements the exact criterion leaves to float32's rounding (``bf16_reference``)."""
    taken = None if package is None else package.grads
    if c.refit is None:
        return _run(c, taken=taken)[0]
    # a first fit stopped after batch `refit` (its open windows dropped, unstepped), then a new fit of the same
    # model: new optimizers, schedulers and callbacks; the model's progress, first k and decay residual go on
    _, carried = _run(c, stop=(c.refit[0], c.refit[1]), taken=taken)
    return _run(c, carried, taken=taken)[0]


def _run(
    c: Config,
    carried: dict[str, Any] | None = None,
    stop: tuple[int, int] | None = None,
    taken: list[list[Tensor | None]] | None = None,
) -> tuple[Result, Any]:
    data = Data(c)
    net = make_net(c.seed, c) if carried is None else carried["net"]
    if c.bf16 and carried is None:  # (`precision="bf16-true"`: the parameters rounded to bf16 once)
        net = net.to(torch.bfloat16)
    bn = BatchNormStatistics(c, net) if carried is None else carried["bn"]
    if c.unfreeze is not None:  # frozen until it joins the optimizer at batch `c.unfreeze`
        net[0].requires_grad_(False)
    guide = make_net(c.seed + 1) if c.guide and c.mode == "cached" else None  # (the cached mode's guide)
    if guide is not None and c.bf16:
        guide = guide.to(torch.bfloat16)
    opts = make_optimizers(c, net)
    sched = make_scheduler(c, opts[0])
    interval = None if c.scheduler is None else c.scheduler.get("interval", "epoch")
    by_model = c.adapter == "mixin" and c.schedulers_by == "user"  # (Lightning's manual contract)
    plateau = c.scheduler is not None and c.scheduler["kind"] == "plateau"
    average: list[Tensor] = []  # StochasticWeightAveraging's, of the parameters at each SWA epoch's start
    p = {"epoch": 0, "step": 0, "samples": 0, "items": 0, "scaled_steps": 0.0}
    noise = NoiseReference(c)  # `NoiseScale` and AdaScale's estimates (a refit's go on)
    first_k: int | None = None
    residual: list[Tensor | None] | None = None
    lrs: list[list[float]] = []
    best, wait = math.inf, 0  # EarlyStopping(monitor=c.monitor, patience=1)
    last_loss: float | None = None  # the last stepped window's loss (`accum/loss`)
    if carried is not None:
        p, first_k, residual, last_loss = carried["p"], carried["first_k"], carried["residual"], carried["last_loss"]
        noise = carried["noise"]
    step0 = p["step"]  # (each fit's Trainer counts its own steps)
    step_plateau = plateau and interval == "step"  # (on the batch's probe after its step: `batch_probe`)
    ema: list[Tensor] | None = None
    batches = c.batches_per_epoch()
    done = False
    # under bf16: each step's gradient before clipping, over both fits of a refit (the package's `taken` alike)
    grads: list[list[Tensor | None]] | None = (carried or {}).get("grads", []) if c.bf16 else None
    first = len(data.batch(0)["x"])  # (the fit's first batch: `microbatch_size="auto"` finds its size on it)
    for epoch in range(c.epochs):
        p["epoch"] = epoch
        if c.swa is not None and epoch >= c.swa[1] - 1:  # SWA (from epoch `swa_epoch_start - 1`): its SWALR
            # replaces the scheduler; the average takes the parameters at each epoch's start
            if not average:
                for g in opts[0].param_groups:
                    g["initial_lr"] = c.swa[0]
                sched = SWALR(opts[0], swa_lr=[c.swa[0]] * len(opts[0].param_groups), anneal_epochs=10,
                              anneal_strategy="cos", last_epoch=c.epochs)  # fmt: skip
                interval, plateau = "epoch", False
                # (Lightning's average is a copy of the module made before the precision converted it: float64)
                average = [prm.detach().to(torch.float64, copy=True) for prm in net.parameters()]
            else:
                n = epoch - (c.swa[1] - 1)  # (averaged so far)
                average = [a + (prm.detach().double() - a) / (n + 1) for a, prm in zip(average, net.parameters(),
                                                                                        strict=True)]  # fmt: skip
        # (the mixin: a skipped batch is in no window, unless its block ran a forward (`skip_forward`); the callback: a
        # window is k of the loader's batches, and one whose `training_step` returned `None` puts nothing in it)
        trained = [j for j in range(batches) if c.adapter != "mixin" or c.skip_forward or j not in c.skip]
        i, end = 0, -1  # the position in `trained`; the batch index the last window was stepped at
        while i < len(trained) and not done:
            if c.schedule["family"] == "budget":  # closed by the count over ranks (`budget_span`)
                span, full, k = budget_span(c, data, trained[i:], p)
                first_k = first_k or k  # (the first window's budget: what `lr_scaling` is relative to)
            else:
                k = noise.k(p["step"]) if noise.spec is not None else schedule_k(c.schedule, p)
                first_k = first_k or k
                span = trained[i : i + k]
                full = len(span) == k
                if c.adapter == "mixin" and c.skip_forward:
                    span, full = _mixin_span(c, trained[i:], k)
            i += len(span)
            indices = [j for j in span if j not in c.skip]
            # each process's batches j: the data's j * world + r
            window = [data.batch(j * c.world + r) for j in indices for r in range(c.world)]
            # a window cut short at the epoch's end is stepped at its last batch, trained or not; the model's own
            # step (after the block when `acc.last`) comes where a window is full or the epoch's last batch ran
            end = span[-1] if full else batches - 1
            if stop is not None and (epoch, end) > stop:  # the loop stopped inside this window: dropped
                done = True
                break
            due = not by_model or full or span[-1] == batches - 1
            joins = None  # the batch of this window at which the first layer joins the optimizer
            if c.unfreeze is not None and c.unfreeze[0] == epoch and c.unfreeze[1] in span:
                joins = c.unfreeze[1]
            samples = sum(len(b["x"]) for b in window)
            counts = [float(b["mask"].sum()) if c.count else float(len(b["x"])) for b in window]
            tokens = sum(counts)
            if not window or (c.normalize == "items" and tokens == 0):  # nothing went in: no step, nothing changes
                bn.unstepped(c, net, window, _skipped(c, data, span))
                if joins is not None:
                    _join(net, opts[0])
                p["samples"] += samples
                if interval == "step" and by_model and due:  # (the model steps its scheduler at `acc.last` anyway)
                    sched.step()
                continue
            factor = gain = 1.0
            if c.lr_scaling == "adascale":  # (from the windows measured before this one)
                factor = gain = noise.gain(samples if c.normalize == "mean" else tokens)
            elif c.lr_scaling is not None:
                if c.schedule["family"] == "budget":  # the window's real size over the first window's budget
                    k = samples if c.schedule["unit"] == "samples" else int(tokens)
                factor = k / first_k if c.lr_scaling == "linear" else math.sqrt(k / first_k)
            if c.lr_schedule is not None:
                factor *= warmup_cosine(c.lr_schedule, p)
            if c.windows == "each":  # a window per optimizer, stepped one after the other
                assert not noise.active, "the fuzzer draws no noise measurement with a window per optimizer"
                if c.bf16:  # (the bf16 windows, pass by pass: `bf16_reference`)
                    wide = c.grad_accum_dtype is not None or c.schedule["family"] == "budget"
                    normaliser = float(len(window)) if c.normalize == "mean" else tokens
                    assert grads is not None
                    each = _each_bf16(c, net, opts, window, 1 if wide else k, normaliser, first, factor, lrs, grads,
                                      taken)  # fmt: skip
                else:
                    each = _each(c, net, opts, window, tokens, factor, lrs)
                for g, loss in enumerate(each):  # (each step, in turn)
                    last_loss = last_loss if g else float(loss)  # (`accum/opt0/loss`)
                    ema = _ema(c, net, ema)
                p["step"] += 1
                p["samples"] += samples
                p["items"] += int(tokens)
                p["scaled_steps"] += 1.0
                if interval == "step" and due:
                    sched.step(batch_probe(net, data.batch(end))) if step_plateau else sched.step()
                if c.max_steps != -1 and (p["step"] - step0) * len(opts) >= c.max_steps:
                    done = True
                continue
            if c.bf16:  # each pass in bf16, the window's gradient as the docs define it (`bf16_reference`)
                wide = c.grad_accum_dtype is not None or c.schedule["family"] == "budget"
                divisor = 1 if wide else k  # (what each loss reaches backward divided by)
                normaliser = float(len(window)) if c.normalize == "mean" else tokens
                join = None
                if joins is not None:
                    join = (sum(1 for j in indices if j < joins) * c.world, lambda: _join(net, opts[0]))
                with bn.window():
                    landed = bf16_reference.window_gradient(c, net, window, divisor, normaliser, first, join, guide)
                for opt in opts:  # in order; each clips its own parameters, in place
                    mine = [prm for g in opt.param_groups for prm in g["params"]]
                    assert grads is not None
                    landed.take(mine, taken[len(grads)] if taken is not None and len(grads) < len(taken) else None)
                    _step(c, opt, factor, lrs, grads)
                ema = _ema(c, net, ema)
                p["step"] += 1
                p["samples"] += samples
                p["items"] += int(tokens)
                p["scaled_steps"] += gain
                if interval == "step" and due:
                    sched.step(batch_probe(net, data.batch(end))) if step_plateau else sched.step()
                if c.max_steps != -1 and (p["step"] - step0) * len(opts) >= c.max_steps:
                    done = True
                continue
            with bn.window():
                with torch.no_grad():  # (the skipped batches' forwards, no backward: `skip_forward`)
                    for x in _skipped(c, data, span):
                        net(x)
                if joins is not None:  # the batches before the join ran with the first layer frozen
                    before = [data.batch(j * c.world + r) for j in indices if j < joins for r in range(c.world)]
                    terms = _terms(c, net, before, tokens, len(window), guide)
                    _join(net, opts[0])
                    after = [data.batch(j * c.world + r) for j in indices if j >= joins for r in range(c.world)]
                    terms += _terms(c, net, after, tokens, len(window), guide)
                else:
                    terms = _terms(c, net, window, tokens, len(window), guide)
            loss = sum(terms, torch.zeros((), dtype=torch.float64))
            net.zero_grad(set_to_none=False)
            loss.backward()
            if noise.active:  # the window's own gradient, before the decay's residual joins it
                with bn.untouched():
                    noise.measure(net, window, c.world, guide, piece(c))
            if c.decay is not None:  # (a parameter without a gradient, frozen till `unfreeze`, has no residual)
                f, mode, bias = c.decay
                for j, prm in enumerate(net.parameters()):
                    if prm.grad is None:
                        continue
                    g = prm.grad if mode == "sum" else (1 - f) * prm.grad
                    kept = None if residual is None else residual[j]
                    prm.grad = g if kept is None else g + f * kept
                if bias:
                    for prm in net.parameters():
                        if prm.grad is not None:
                            prm.grad = prm.grad / (1 - f ** (p["step"] + 1))
            for opt in opts:  # in order; each clips its own parameters, in place
                _step(c, opt, factor, lrs)
            if c.decay is not None:
                f, _, bias = c.decay
                correction = 1 - f ** (p["step"] + 1) if bias else 1.0
                residual = [None if prm.grad is None else prm.grad.clone() * correction for prm in net.parameters()]
            last_loss = float(loss)
            ema = _ema(c, net, ema)
            p["step"] += 1
            p["samples"] += samples
            p["items"] += int(tokens)
            p["scaled_steps"] += gain
            if interval == "step" and due:
                sched.step(batch_probe(net, data.batch(end))) if step_plateau else sched.step()
            if c.max_steps != -1 and (p["step"] - step0) * len(opts) >= c.max_steps:  # (manual: each optimizer's
                done = True  # step counts)
        # the epoch's end (also one cut short by max_steps; Lightning steps an epoch's scheduler only when the
        # epoch ran all its batches, the model in `on_train_epoch_end` at every epoch's end)
        ran_out = i >= len(trained) and (not done or end == batches - 1)
        watched = probe_loss(net, data) if c.monitor == "probe" else last_loss  # (None: no window stepped yet)
        if "early_stopping" in c.callbacks and watched is not None:
            if watched < best:
                best, wait = watched, 0
            else:
                wait += 1
                done = done or wait >= 1
        if interval == "epoch" and (ran_out or by_model):
            if not plateau:
                sched.step()
            elif watched is not None:
                sched.step(watched)
        if done:
            break
    if average and epoch == c.epochs - 1:  # SWA's average goes into the model when the last epoch ran
        with torch.no_grad():
            for prm, a in zip(net.parameters(), average, strict=True):
                prm.copy_(a)
    steps = (p["step"] - step0) * len(opts)  # (manual optimization counts each optimizer's step)
    result = Result([prm.detach().clone() for prm in net.parameters()], steps, lrs, optimizer_state(c, opts), ema,
                    bn.result(), grads)  # fmt: skip
    return result, {"net": net, "bn": bn, "p": p, "first_k": first_k, "residual": residual, "last_loss": last_loss,
                    "noise": noise, "grads": grads}
