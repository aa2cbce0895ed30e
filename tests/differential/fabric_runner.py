"""One configuration through ``FabricAccumulator`` in a Fabric loop (the ``"fabric"`` adapter): the
options a Fabric loop has (schedules and units, normalisation and reduction, micro-batches of no
items, epochs, batch limits, ``max_steps``, optimizers, clipping, LR scaling and schedules) and
checkpoints written with ``fabric.save`` at any batch, resumed with ``fabric.load`` in a fresh
model, optimizer and accumulator."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
from lightning.fabric import Fabric

from lightning_accum.fabric import FabricAccumulator

from .configs import Config
from .model import Data, count_tokens, make_net, micro_loss
from .package import lr_schedule, schedule
from .reference import Result, make_optimizers, optimizer_state


class _Run:
    """A fresh model, optimizer and accumulator (a process starting, or resuming from ``path``)."""

    def __init__(self, c: Config, lrs: dict[int, list[float]], path: Path | None = None) -> None:
        self.fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # (the reference's initial weights are drawn in float32)
        try:
            self.net = make_net(c.seed)
        finally:
            torch.set_default_dtype(previous)
        (raw,) = make_optimizers(c, self.net)
        self.model, self.optimizer = self.fabric.setup(self.net, raw)
        clip = {} if c.clip is None else {"gradient_clip_val": c.clip[0], "gradient_clip_algorithm": c.clip[1]}
        self.acc = FabricAccumulator(
            self.fabric, self.model, self.optimizer, schedule(c.schedule), normalize=c.normalize,  # type: ignore[arg-type]
            count=count_tokens if c.count else None, reduction=c.reduction if c.normalize == "items" else None,  # type: ignore[arg-type]
            lr_scaling=c.lr_scaling, lr_schedule=lr_schedule(c), log=False, **clip,  # type: ignore[arg-type]
        )  # fmt: skip
        self.state = {"model": self.model, "optimizer": self.optimizer, "accumulation": self.acc}
        record = lambda o, *_: lrs.__setitem__(self.acc.progress.step, [g["lr"] for g in o.param_groups])  # noqa: E731
        raw.register_step_post_hook(record)
        if path is not None:
            self.fabric.load(path, self.state)


def run(c: Config) -> Result:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (Fabric's "64-true" casts outputs to the default dtype)
    try:
        with warnings.catch_warnings():  # (the package's, on a window of no items: the runner's own business)
            warnings.simplefilter("ignore")
            return _run(c)
    finally:
        torch.set_default_dtype(previous)


def _run(c: Config) -> Result:
    data, lrs = Data(c), {}  # type: ignore[var-annotated]
    saves = {(int(e), int(b)) for kind, e, b in c.interruptions if kind == "save"}
    with tempfile.TemporaryDirectory() as tmp:
        run = _Run(c, lrs)
        done = False
        for epoch in range(c.epochs):
            for j in range(c.batches_per_epoch()):
                batch = data.batch(j)
                with run.acc.accumulate(batch, epoch=epoch) as step:
                    total, _, positions = micro_loss(run.model, batch)
                    if c.normalize == "mean":
                        step.backward(total / positions)
                    else:
                        step.backward(total / batch["mask"].sum() if c.reduction == "mean" else total)
                if c.max_steps != -1 and run.acc.progress.step >= c.max_steps:
                    done = True
                    break
                if (epoch, j) in saves:  # a checkpoint, then a fresh process resuming from it
                    path = Path(tmp) / f"{epoch}-{j}.ckpt"
                    run.fabric.save(path, run.state)
                    run = _Run(c, lrs, path)
            if done:
                break
            run.acc.flush()
        params = [p.detach().clone() for p in run.net.parameters()]
        out_lrs = [lrs[s] for s in sorted(lrs)]
        return Result(params, run.acc.progress.step, out_lrs, optimizer_state(c, [run.optimizer.optimizer]), None)


__all__ = ["run"]
