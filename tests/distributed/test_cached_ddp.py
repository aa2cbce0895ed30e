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


@pytest.mark.parametrize("block", [None, 2], ids=["whole-loss", "rank-local"])
def test_fsdp2_with_gather_equals_one_process(tmp_path: Path, block: int | None) -> None:
    """FSDP2: the graph-free first pass, the replayed chunks and the skipped sync of all chunks but
    the window's last work on sharded towers; in blocks, each rank's own rows."""
    pytest.importorskip("torch.distributed.fsdp")
    from test_cached import info_nce_rows
    from test_fsdp2 import ForkedModelParallel, shard

    class Sharded(Gathered):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            with self.accumulate(batch) as acc:
                acc.backward_cached([self.q_net, self.d_net], [batch["q"], batch["d"]], info_nce_rows, chunk_size=4,
                                    gather=True, loss_chunk_size=block)  # fmt: skip

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


class HardNegatives(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each query with its positive passage and two hard negatives (DPR's layout)."""

    def __init__(self, n: int) -> None:
        from test_cached import data

        self.q, _ = data(n, seed=3)
        self.d = data(3 * n, seed=4)[0].reshape(n, 3, -1)

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"q": self.q[i], "d": self.d[i]}


class UnevenRanks(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Rank 0 gets batches of 4 queries, rank 1 of 6, from its own half of the data."""

    SIZES = (4, 6)
    BATCHES = 3

    def __iter__(self):  # type: ignore[no-untyped-def]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        start = 0 if rank == 0 else self.SIZES[0] * self.BATCHES
        size = self.SIZES[rank]
        for i in range(self.BATCHES):
            yield list(range(start + i * size, start + (i + 1) * size))

    def __len__(self) -> int:
        return self.BATCHES


class Retrieval(TwoTower):
    """Queries against their passages with hard negatives, cached, every rank's in the loss."""

    def __init__(self) -> None:
        super().__init__(1, chunk=None)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        from test_cached import info_nce_hard

        passages = batch["d"].reshape(-1, batch["d"].shape[-1])  # B x (1 + n) rows
        with self.accumulate(batch) as acc:
            acc.backward_cached(
                [self.q_net, self.d_net], [batch["q"], passages], info_nce_hard, chunk_size=[3, 5], gather=True
            )


def test_hard_negatives_on_ranks_of_different_batch_sizes_equal_one_process(tmp_path: Path) -> None:
    """Rank 0 holds 4 queries and 12 passages per batch, rank 1 6 and 18: with ``gather=True`` the
    loss sees all 10 queries against all 30 passages, as one process with both ranks' batches."""
    from test_cached import info_nce_hard, tower

    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(callbacks=[Report(tmp_path)], max_epochs=1, devices=2, strategy=strategy, use_distributed_sampler=False)
    data = HardNegatives(30)
    t.fit(Retrieval(), DataLoader(data, batch_sampler=UnevenRanks()))
    q_net, d_net = tower(), tower(seed=1)
    opt = torch.optim.SGD([*q_net.parameters(), *d_net.parameters()], lr=0.5)
    for i in range(UnevenRanks.BATCHES):
        rows = list(range(4 * i, 4 * i + 4)) + list(range(12 + 6 * i, 12 + 6 * i + 6))  # rank 0's, then rank 1's
        info_nce_hard(q_net(data.q[rows]), d_net(data.d[rows].reshape(-1, data.d.shape[-1]))).backward()
        opt.step()
        opt.zero_grad()
    expected = [p.detach() for p in [*q_net.parameters(), *d_net.parameters()]]
    for r in range(2):
        got = [torch.tensor(p, dtype=torch.float64) for p in json.loads((tmp_path / f"rank{r}.json").read_text())]
        assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12


class RankSizes(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """Each rank's batches of the given sizes, from its own stretch of the data (rank 0's first)."""

    def __init__(self, sizes: list[list[int]]) -> None:
        self.sizes = sizes

    def batches(self, rank: int) -> list[list[int]]:
        start = sum(sum(s) for s in self.sizes[:rank])
        out = []
        for size in self.sizes[rank]:
            out.append(list(range(start, start + size)))
            start += size
        return out

    def __iter__(self):  # type: ignore[no-untyped-def]
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        yield from self.batches(rank)

    def __len__(self) -> int:
        return len(self.sizes[0])


class RankLocal(TwoTower):
    """Hard negatives, every rank's in the loss, the loss in blocks of 2 query rows (each rank its own),
    a learned temperature; with ``items``: ``normalize="items"`` and each rank's query count. The rows
    each block scored, and the score block's shape, are kept."""

    def __init__(self, block: int | None, items: bool) -> None:
        super().__init__(2, chunk=None, normalize="items" if items else "mean")
        self.temperature = torch.nn.Parameter(torch.tensor(0.6, dtype=torch.float64))
        self.block, self.items = block, items
        self.seen: list[list[int]] = []

    def loss(self, q: torch.Tensor, d: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        from test_cached import info_nce_rows

        if rows is not None:
            self.seen.append([rows.start, rows.stop, *(q[rows] @ d.T).shape])
        return info_nce_rows(q, d, rows, self.temperature)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        passages = batch["d"].reshape(-1, batch["d"].shape[-1])
        with self.accumulate(batch) as acc:
            acc.backward_cached(
                [self.q_net, self.d_net], [batch["q"], passages], self.loss, chunk_size=[3, 5], gather=True,
                loss_chunk_size=self.block, items=len(batch["q"]) if self.items else None,
            )  # fmt: skip


class RowsReport(Report):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        (self.out / f"rows{trainer.global_rank}.json").write_text(json.dumps(pl_module.seen))  # type: ignore[arg-type]


def one_process(sizes: list[list[int]], data: HardNegatives, windows: list[int], items: bool) -> list[torch.Tensor]:
    """The float64 reference: each batch is every rank's rows (rank 0's first) in one loss; a window's
    gradient is the mean of its batches' (``"mean"``) or their query-count-weighted mean (``"items"``)."""
    from test_cached import info_nce_rows, tower

    q_net, d_net = tower(), tower(seed=1)
    temperature = torch.nn.Parameter(torch.tensor(0.6, dtype=torch.float64))
    params = [temperature, *q_net.parameters(), *d_net.parameters()]  # (a module's own parameters come first)
    opt = torch.optim.SGD(params, lr=0.5)
    sampler = RankSizes(sizes)
    batches = [a + b for a, b in zip(sampler.batches(0), sampler.batches(1), strict=True)]
    i = 0
    for k in windows:
        window = batches[i : i + k]
        total = sum(len(rows) for rows in window)
        for rows in window:
            loss = info_nce_rows(q_net(data.q[rows]), d_net(data.d[rows].reshape(-1, data.d.shape[-1])), None,
                                 temperature)  # fmt: skip
            (loss * len(rows) / total if items else loss / len(window)).backward()
        opt.step()
        opt.zero_grad()
        i += k
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    ("block", "items"), [(2, False), (2, True), (None, True)], ids=["rank-local", "rank-local-items", "items"]
)
def test_gathered_loss_on_uneven_ranks_equals_one_process(tmp_path: Path, block: int | None, items: bool) -> None:
    """Ranks of different batch sizes (rank 0: 4, 2, 3 queries; rank 1: 2, 5, 1), hard negatives, a
    learned temperature, windows of 2 batches. In blocks, each rank scores only its own query rows
    against every rank's passages (B_local x B_global(1 + n) per rank); with ``items=len(queries)``
    and ``normalize="items"`` each batch weighs by all ranks' count (issue 31: each rank's own count
    made it 1.06 off). Both equal one process with both ranks' batches, to 1e-12."""
    sizes = [[4, 2, 3], [2, 5, 1]]
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    t = trainer(callbacks=[RowsReport(tmp_path)], max_epochs=1, devices=2, strategy=strategy,
                use_distributed_sampler=False)  # fmt: skip
    data = HardNegatives(sum(map(sum, sizes)))
    t.fit(RankLocal(block, items), DataLoader(data, batch_sampler=RankSizes(sizes)))
    expected = one_process(sizes, data, [2, 1], items)
    for r in range(2):
        got = [torch.tensor(p, dtype=torch.float64) for p in json.loads((tmp_path / f"rank{r}.json").read_text())]
        assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) <= 1e-12
        seen = json.loads((tmp_path / f"rows{r}.json").read_text())
        if block is None:
            assert seen == []
            continue
        want = []
        for own, other in zip(sizes[r], sizes[1 - r], strict=True):
            start = 0 if r == 0 else other  # (rank 1's rows follow rank 0's)
            want += [[s, min(s + 2, start + own), min(s + 2, start + own) - s, 3 * (own + other)]
                     for s in range(start, start + own, 2)]  # fmt: skip
        assert seen == want  # only its own rows, 2 at a time, against all ranks' passages
