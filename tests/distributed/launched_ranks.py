"""One rank of the launcher tests (``tests/distributed/test_launchers.py``), started the way users start
ranks: by ``torchrun``, by SLURM's ``srun`` (its environment variables set by hand) or on each "node" of
a ``num_nodes=2`` run (``NODE_RANK`` and ``MASTER_ADDR`` set, Lightning starting the node's other rank).

``python launched_ranks.py OUT NUM_NODES`` runs, in this one process start, for each adapter (the callback,
the mixin, the Fabric helper): a fit over the union of the data (each rank every world-th sample) that saves
a checkpoint inside a window on the way, then a fit resumed from that checkpoint. Every checkpoint is saved
to ``OUT/node{node_rank}/``: only global rank 0 may write, so only ``node0/`` gets files, and every rank of
every node resumes from the one in ``node0/`` (a shared file system stands in for copying it). Each rank
writes ``OUT/rank{global_rank}.json``: its ranks, the cluster environments Lightning and Fabric chose, the
checkpoint files each node's directory held after the saves, and every run's final parameters.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, Piecewise
from lightning_accum.fabric import FabricAccumulator

from helpers import (
    ManualTokenModel,
    RankStrided,
    ResumableLoader,
    TokenData,
    TokenModel,
    count_tokens,
    make_net,
    make_optimizer,
    rank_batches,
    token_losses,
    trainer,
)

SCHEDULE = Piecewise({0: 2, 2: 3}, unit="step")  # per rank on 2 ranks: [0-1] [2-3] [4-6] [7-9] [10-11]; on 4: ...[4-5]
DATA = TokenData(48)  # batches of 2: 12 per rank on 2 ranks, 6 on 4
BATCH = 2
SAVE_AT = 4  # (epoch 0) the window [4-6] (2 ranks) or [4-5] (4 ranks) after its first micro-batch
EPOCHS = 2


class ShardedLoader(ResumableLoader):
    """Every world-th sample from the rank's own on; resumes after the batches Lightning processed."""

    def __init__(self) -> None:
        DataLoader.__init__(self, DATA, batch_size=BATCH, sampler=RankStrided(len(DATA)))
        self._yielded, self._skip = 0, 0
        self.trainer: pl.Trainer | None = None

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"consumed": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}


class SaveInside(pl.Callback):
    """Saves ``name`` into this node's directory inside a window (every rank calls it; rank 0 writes)."""

    def __init__(self, out: Path, name: str, data: ShardedLoader) -> None:
        self.out, self.name, self.data = out, name, data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.data.trainer = trainer

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == (0, SAVE_AT):
            trainer.save_checkpoint(self.out / f"node{trainer.node_rank}" / self.name)


def fit_trainer(out: Path, adapter: str, num_nodes: int, resume: Path | None, report: dict[str, Any]) -> list[Any]:
    if adapter == "callback":
        model: pl.LightningModule = TokenModel(reduction="sum")
        callbacks: list[pl.Callback] = [
            AccumulationScheduler(SCHEDULE, normalize="items", count=count_tokens, reduction="sum")
        ]
    else:
        model, callbacks = (
            ManualTokenModel(reduction="sum", schedule=SCHEDULE, normalize="items", count=count_tokens),
            [],
        )
    data = ShardedLoader()
    t = trainer(
        callbacks=[*callbacks, SaveInside(out, f"{adapter}.ckpt", data)],
        max_epochs=EPOCHS,
        devices=2,
        num_nodes=num_nodes,
        strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=False),
        use_distributed_sampler=False,
    )
    t.fit(model, data, ckpt_path=resume)
    report["ranks"] = [t.global_rank, t.local_rank, t.node_rank, t.world_size]
    report["trainer_environment"] = type(t.strategy.cluster_environment).__name__
    return [p.detach().tolist() for p in model.parameters()]


def fit_fabric(fabric: Fabric, out: Path, resume: Path | None) -> list[Any]:
    """The loop a user writes: saves inside a window after micro-batch ``SAVE_AT`` of epoch 0."""
    net = make_net()  # (made as the reference makes it: under the float32 default dtype)
    torch.set_default_dtype(torch.float64)  # Fabric's "64-true" casts the outputs to the default dtype
    model, optimizer = fabric.setup(net, make_optimizer("sgd", net.parameters(), 0.1))
    acc = FabricAccumulator(fabric, model, optimizer, SCHEDULE, normalize="items", count=count_tokens, reduction="sum")
    state = {"model": model, "optimizer": optimizer, "accumulation": acc, "done": 0}
    if resume is not None:
        fabric.load(resume, state)
    batches = rank_batches(DATA, BATCH, world=fabric.world_size)[fabric.global_rank]
    seen = 0
    for epoch in range(EPOCHS):
        for i, batch in enumerate(batches):
            seen += 1
            if seen <= state["done"]:
                continue
            with acc.accumulate(batch, epoch=epoch) as step:
                total, _ = token_losses(model, batch)
                step.backward(total)
            if (epoch, i) == (0, SAVE_AT) and resume is None:
                state["done"] = seen
                fabric.save(out / f"node{fabric.node_rank}" / "fabric.ckpt", state)
                fabric.barrier()
        acc.flush()
    torch.set_default_dtype(torch.float32)
    return [p.detach().tolist() for p in net.parameters()]


def files(out: Path, nodes: int) -> dict[str, list[str]]:
    return {f"node{n}": sorted(p.name for p in (out / f"node{n}").glob("*")) for n in range(nodes)}


def main(argv: Sequence[str]) -> None:
    out, num_nodes = Path(argv[0]), int(argv[1])
    report: dict[str, Any] = {}
    for adapter in ("callback", "mixin"):
        report[adapter] = fit_trainer(out, adapter, num_nodes, None, report)
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=num_nodes, strategy="ddp", precision="64-true")
    fabric.launch()
    report["fabric_environment"] = type(fabric.strategy.cluster_environment).__name__  # type: ignore[attr-defined]
    report["fabric"] = fit_fabric(fabric, out, None)
    fabric.barrier()
    report["saved"] = files(out, num_nodes)
    for adapter in ("callback", "mixin"):
        report[f"{adapter} resumed"] = fit_trainer(out, adapter, num_nodes, out / "node0" / f"{adapter}.ckpt", report)
    report["fabric resumed"] = fit_fabric(fabric, out, out / "node0" / "fabric.ckpt")
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    fabric.barrier()  # every rank's report is written before any rank's process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (as the forked test ranks do: no interpreter shutdown racing gloo's threads)


if __name__ == "__main__":
    main(sys.argv[1:])
