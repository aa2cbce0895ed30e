"""One configuration through ``FabricAccumulator`` in a Fabric loop (the ``"fabric"`` adapter): the
options a Fabric loop has (schedules and units, normalisation and reduction, micro-batches of no
items, epochs, batch limits, ``max_steps``, optimizers, clipping, LR scaling and schedules), one or
two backward passes per micro-batch, loops with or without ``epoch=`` (refused first where a schedule
is keyed on epochs), and checkpoints written with ``fabric.save`` at any batch, resumed with
``fabric.load`` in a fresh model, optimizer and accumulator (and saved again right after the load,
then resumed from that). On one process here; ``ranks.py`` runs the same loop on 2."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_accum._core import ahead
from lightning_accum.fabric import FabricAccumulator

from .configs import Config
from .model import Data, count_tokens, errors, make_net
from .package import batchnorm, grads_of, lr_schedule, schedule, wide
from .reference import Result, make_optimizers, optimizer_state


class _Run:
    """A fresh model, optimizer and accumulator (a process starting, or resuming from ``path``)."""

    def __init__(
        self, c: Config, fabric: Any, lrs: dict[int, list[float]], path: Path | None = None,
        grads: dict[int, list[torch.Tensor | None]] | None = None,
    ) -> None:
        self.fabric = fabric
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # (the reference's initial weights are drawn in float32)
        try:
            self.net = make_net(c.seed, c)
        finally:
            torch.set_default_dtype(previous)
        if c.strategy == "fsdp2":  # (the optimizer over the sharded parameters)
            self.model = fabric.setup_module(self.net)
            (raw,) = make_optimizers(c, self.model)
            self.optimizer = fabric.setup_optimizers(raw)
        else:
            (raw,) = make_optimizers(c, self.net)
            self.model, self.optimizer = fabric.setup(self.net, raw)
        clip = {} if c.clip is None else {"gradient_clip_val": c.clip[0], "gradient_clip_algorithm": c.clip[1]}
        self.acc = FabricAccumulator(
            fabric, self.model, self.optimizer, schedule(c.schedule), normalize=c.normalize,  # type: ignore[arg-type]
            count=count_tokens if c.count else None, reduction=c.reduction if c.normalize == "items" else None,  # type: ignore[arg-type]
            lr_scaling=c.lr_scaling, lr_schedule=lr_schedule(c), log=False, **clip, **batchnorm(c),  # type: ignore[arg-type]
            **wide(c),
        )  # fmt: skip
        self.state = {"model": self.model, "optimizer": self.optimizer, "accumulation": self.acc}
        if path is not None:
            fabric.load(path, self.state)
            if self.state["accumulation"] is not self.acc:  # (FSDP2's sharded checkpoint hands the state back)
                self.acc.load_state_dict(self.state["accumulation"])
                self.state["accumulation"] = self.acc
        # (after the load, and not while saving: under FSDP2 torch's checkpointing steps an optimizer without state
        # once with a learning rate of 0, to make its state)
        self.saving = False

        def record(o: Any, *_: Any) -> None:
            if self.saving:
                return
            lrs[self.acc.progress.step] = [g["lr"] for g in o.param_groups]
            if grads is not None:  # (noted before clipping, where it clips: `loop`)
                before = getattr(fabric, "_clipped", None)
                grads[self.acc.progress.step] = grads_of(o) if before is None else before
                fabric._clipped = None

        raw.register_step_post_hook(record)

    def save(self, path: Path) -> None:
        self.saving = True
        try:
            self.fabric.save(path, self.state)
        finally:
            self.saving = False

    def params(self) -> list[torch.Tensor]:
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.model.parameters()]
        return [p.detach().clone() for p in whole]


def run(c: Config) -> Result:
    previous, reading = torch.get_default_dtype(), ahead.ON_ONE_PROCESS
    torch.set_default_dtype(default_dtype(c))
    ahead.ON_ONE_PROCESS = True  # (issue 52: `read_ahead` reads ahead on one process too, as on ranks)
    try:
        with warnings.catch_warnings():  # (the package's, on a window of no items: the runner's own business)
            warnings.simplefilter("ignore")
            with tempfile.TemporaryDirectory() as tmp:
                return loop(c, lambda: Fabric(accelerator="cpu", devices=1, precision=c.precision), Path(tmp))
    finally:
        torch.set_default_dtype(previous)
        ahead.ON_ONE_PROCESS = reading


def default_dtype(c: Config) -> torch.dtype:
    """The loop's default dtype: float64 under "64-true" (Fabric casts the module's outputs to it), float32 under
    "bf16-true" (a user's; the outputs come back to it from bf16)."""
    return torch.float32 if c.bf16 else torch.float64


def user_batch(c: Config, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The data as the user's loop has it: the fuzzer's float64, or float32 under bf16 (Fabric converts what enters
    the module to bf16)."""
    return {k: v.float() for k, v in batch.items()} if c.bf16 else batch


def _note_before_clipping(fabric: Any) -> None:
    """``fabric.clip_gradients`` noting the gradient the step gets before clipping it (``fabric._clipped``)."""
    clip = fabric.clip_gradients

    def noting(module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        fabric._clipped = grads_of(optimizer)
        return clip(module, optimizer, *args, **kwargs)

    fabric.clip_gradients = noting
    fabric._noting = True


def loop(c: Config, make_fabric: Callable[[], Any], tmp: Path, saved: list[Path] | None = None) -> Result:
    """The user's loop on this process (rank r of ``c.world`` takes the data's batches ``j * world + r``);
    ``saved``: where the checkpoints written after a block that did not step go (for the world-size check: one
    that holds an open window must be refused on another number of ranks)."""
    data, lrs = Data(c), {}  # type: ignore[var-annotated]
    grads: dict[int, list[torch.Tensor | None]] | None = {} if c.bf16 else None
    saves = {(int(e), int(b)) for kind, e, b in c.interruptions if kind == "save"}
    fabric = make_fabric()
    if grads is not None and not getattr(fabric, "_noting", False):
        _note_before_clipping(fabric)
    fabric._clipped = None
    rank = fabric.global_rank
    run = _Run(c, fabric, lrs, grads=grads)
    if not c.epoch_arg and c.epoch_keyed():  # refused, before anything changes: then given
        try:
            with run.acc.accumulate(user_batch(c, data.batch(rank))):
                raise AssertionError("a schedule keyed on epochs was taken without `epoch=`")
        except ValueError as error:
            assert "keyed on epochs" in str(error), error
    epoch_arg = c.epoch_arg or c.epoch_keyed()
    done = False
    batches = c.batches_per_epoch()
    for epoch in range(c.epochs):
        start = 0  # (the loop starts again from the next batch after a resume: `read_ahead` on the new accumulator)
        while start < batches and not done:
            rest = [(j, user_batch(c, data.batch(j * c.world + rank))) for j in range(start, batches)]
            order = iter(rest)
            source = run.acc.read_ahead([b for _, b in rest]) if c.read_ahead else (b for _, b in rest)
            start = batches
            for batch in source:
                j, _ = next(order)
                options = {"epoch": epoch} if epoch_arg else {}
                with run.acc.accumulate(batch, last=c.last_arg and j == batches - 1, **options) as step:
                    backward(c, run.model, batch, step)
                if steps_done(c, run):
                    done = True
                    break
                # a checkpoint, then a fresh process resuming from it (under FSDP2 only where a window just stepped:
                # there the sync skipped inside a window keeps its gradient where no checkpoint reaches it)
                if (epoch, j) in saves and (c.strategy != "fsdp2" or step.stepped):
                    path = tmp / f"{epoch}-{j}.ckpt"
                    run.save(path)
                    if saved is not None and not step.stepped:
                        saved.append(path)
                    run = _Run(c, fabric, lrs, path, grads)
                    if c.resave:  # saved again before the next block, then resumed from that
                        again = tmp / f"{epoch}-{j}-again.ckpt"
                        run.save(again)
                        run = _Run(c, fabric, lrs, again, grads)
                    start = j + 1
                    break
        if done:
            break
        run.acc.flush()
        if steps_done(c, run):  # (the epoch's short last window, stepped by the flush, counts too)
            break
    out_lrs = [lrs[s] for s in sorted(lrs)]
    adam = optimizer_state(c, [run.optimizer.optimizer])
    if adam is not None:  # (FSDP2: each rank holds its shard of Adam's state)
        adam = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()} for s in adam]
    buffers = [b.detach().clone() for b in run.model.buffers()] if c.batchnorm else None
    out_grads = None if grads is None else [grads[s] for s in sorted(grads)]
    return Result(run.params(), run.acc.progress.step, out_lrs, adam, None, buffers, out_grads)


def steps_done(c: Config, run: _Run) -> bool:
    """Whether the loop has made the ``max_steps`` optimizer steps asked for."""
    return c.max_steps != -1 and run.acc.progress.step >= c.max_steps


def backward(c: Config, model: Any, batch: dict[str, torch.Tensor], step: Any) -> None:
    """The micro-batch's loss: one pass, or two (its tokens' errors in two halves, the graph kept between)."""
    err = errors(model(batch["x"]), batch)
    parts = [err] if c.passes == 1 else [err[:, :2], err[:, 2:]]
    for i, part in enumerate(parts):
        total = part.sum()
        if c.normalize == "mean":
            loss = total / err.numel()
        else:
            loss = total / batch["mask"].sum() if c.reduction == "mean" else total
        step.backward(loss, retain_graph=i < len(parts) - 1)


__all__ = ["loop", "run"]
