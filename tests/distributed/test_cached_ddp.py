"""Cached backward on 2 gloo ranks with ``gather=True``: every rank's representations enter the
loss, so 2 ranks of batch B train exactly as one process of batch 2B (float64, to 1e-12)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from test_cached import Pairs, TwoTower, info_nce, reference
from torch.utils.data import DataLoader

from lightning_accum import Piecewise

from helpers import RankStrided, trainer

pytestmark = pytest.mark.slow

N, B = 72, 6  # per rank: 6 batches of 6


class Gathered(TwoTower):
    def __init__(self, gather: bool) -> None:
        super().__init__(Piecewise({0: 2, 2: 4}, unit="step"), chunk=4)  # windows 2, 2, then a short one of 2
        self.gather = gather

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        with self.accumulate(batch) as acc:
            acc.backward_cached(
                [self.q_net, self.d_net], [batch["q"], batch["d"]], info_nce, chunk_size=4, gather=self.gather
            )


class Report(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [p.detach().tolist() for p in pl_module.parameters()]
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(params))


@pytest.mark.parametrize("gather", [True, False])
def test_two_ranks_with_gather_equal_one_process_with_both_batches(tmp_path: Path, gather: bool) -> None:
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(callbacks=[Report(tmp_path)], max_epochs=1, devices=2, strategy=strategy, use_distributed_sampler=False)
    t.fit(Gathered(gather), DataLoader(Pairs(N), batch_size=B, sampler=RankStrided(N)))
    data = Pairs(N)
    ranks = [[list(range(r, N, 2))[i : i + B] for i in range(0, N // 2, B)] for r in range(2)]

    def batch(index: list[int]) -> dict[str, torch.Tensor]:
        return {"q": data.q[index], "d": data.d[index]}

    if gather:  # one process, batch 2B: rank 0's rows, then rank 1's
        expected = reference([2, 2, 2], [batch(a + b) for a, b in zip(*ranks, strict=True)])
    else:  # each rank's own negatives: the mean over ranks of each rank's loss
        expected = reference_local([2, 2, 2], [[batch(i) for i in rank] for rank in ranks])
    for r in range(2):
        got = [torch.tensor(p, dtype=torch.float64) for p in json.loads((tmp_path / f"rank{r}.json").read_text())]
        assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12


def reference_local(schedule: list[int], per_rank: list[list[dict[str, Any]]]) -> list[torch.Tensor]:
    """Without gather: each window's gradient is the mean over ranks and batches of the local losses'."""
    from test_cached import tower

    q_net, d_net = tower(), tower(seed=1)
    opt = torch.optim.SGD([*q_net.parameters(), *d_net.parameters()], lr=0.5)
    i = 0
    for k in schedule:
        for rank in per_rank:
            for b in rank[i : i + k]:
                (info_nce(q_net(b["q"]), d_net(b["d"])) / (k * len(per_rank))).backward()
        opt.step()
        opt.zero_grad()
        i += k
    return [p.detach() for p in [*q_net.parameters(), *d_net.parameters()]]


def test_fsdp2_with_gather_equals_one_process(tmp_path: Path) -> None:
    """FSDP2: the graph-free first pass, the replayed chunks and the skipped sync of all chunks but
    the window's last work on sharded towers."""
    pytest.importorskip("torch.distributed.fsdp")
    from test_fsdp2 import ForkedModelParallel, shard

    class Sharded(Gathered):
        def configure_model(self) -> None:
            shard(self.q_net, self.device_mesh["data_parallel"])
            shard(self.d_net, self.device_mesh["data_parallel"])

    class FullReport(Report):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps([p.detach().tolist() for p in params]))

    t = trainer(
        callbacks=[FullReport(tmp_path)],
        max_epochs=1,
        devices=2,
        strategy=ForkedModelParallel(),
        precision="32-true",  # the strategy refuses "64-true"; the towers are float64 all the same
        use_distributed_sampler=False,
    )
    t.fit(Sharded(True), DataLoader(Pairs(N), batch_size=B, sampler=RankStrided(N)))
    data = Pairs(N)
    ranks = [[list(range(r, N, 2))[i : i + B] for i in range(0, N // 2, B)] for r in range(2)]
    batches = [{"q": data.q[a + b], "d": data.d[a + b]} for a, b in zip(*ranks, strict=True)]
    expected = reference([2, 2, 2], batches)
    for r in range(2):
        got = [torch.tensor(p, dtype=torch.float64) for p in json.loads((tmp_path / f"rank{r}.json").read_text())]
        assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12
