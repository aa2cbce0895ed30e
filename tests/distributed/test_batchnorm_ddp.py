"""``batchnorm="window"`` on 2 gloo ranks: ``SyncBatchNorm`` ends each window with the statistics of the whole
window over all ranks (equal to one process on the union, whatever each rank's micro-batch sizes), and plain
BatchNorm under DDP keeps each rank's own window statistics, rank 0's reaching every rank at the next forward
where ``broadcast_buffers=True`` (Lightning's default). Against a float64 loop that runs each window's samples,
all ranks' for ``SyncBatchNorm`` and one rank's for plain BatchNorm, through one BatchNorm layer as a single batch.

``SyncBatchNorm`` synchronises only CUDA (and XPU, HPU) inputs: ``CPUSyncBatchNorm`` does on CPU, with gloo, what
its kernel does (each forward normalised by all ranks' statistics, its running buffers updated with their mean
and their variance unbiased over the global count), so that the same hooks run here.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_accum import AccumulationScheduler
from lightning_accum._core.batchnorm import WindowBatchNorm

from helpers import ChildLauncher, trainer

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")
from torch.distributed.fsdp import fully_shard

pytestmark = pytest.mark.slow

WORLD = 2
K = 3
SIZES = ([4, 4, 4, 4, 4, 4], [3, 3, 3, 3, 3, 2])  # per rank, its micro-batch sizes: two windows of 3 each
g = torch.Generator().manual_seed(0)
X = [[torch.randn(n, 2, generator=g, dtype=torch.float64) * 3 + 1 for n in sizes] for sizes in SIZES]
Y = [[torch.randn(n, 1, generator=g, dtype=torch.float64) for n in sizes] for sizes in SIZES]


class CPUSyncBatchNorm(nn.SyncBatchNorm):
    """``SyncBatchNorm`` synchronised on CPU (gloo), as its CUDA kernel: the global mean and variance normalise,
    and the running buffers take the mean and the variance unbiased over the global count."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        if self.num_batches_tracked is None:  # (as SyncBatchNorm's own forward)
            raise AssertionError("num_batches_tracked must not be None")
        self.num_batches_tracked.add_(1)
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        count = torch.tensor([float(len(x))], dtype=x.dtype)
        summed = dist_nn.all_reduce(torch.cat([count, x.sum(0)]))
        total, mean = summed[0], summed[1:] / summed[0]
        var = dist_nn.all_reduce(((x - mean) ** 2).sum(0)) / total
        assert self.running_mean is not None and self.running_var is not None
        with torch.no_grad():
            self.running_mean.mul_(1 - m).add_(mean * m)
            self.running_var.mul_(1 - m).add_(var * total / (total - 1) * m)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class Net(nn.Module):
    """Both BatchNorm layers take the input itself (what they are given does not depend on training)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sync, self.plain, self.head = CPUSyncBatchNorm(2), nn.BatchNorm1d(2, momentum=None), nn.Linear(4, 1)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(torch.cat([self.sync(x), self.plain(x)], dim=1))
        return out


def reference(windows: list[list[Tensor]], momentum: float | None, start: nn.BatchNorm1d | None = None) -> Tensor:
    """A float64 BatchNorm layer's buffers after one forward of each window's samples as a single batch."""
    layer = nn.BatchNorm1d(2, momentum=momentum).double()
    if start is not None:
        layer.load_state_dict(start.state_dict())
    with torch.no_grad():
        for window in windows:
            layer(torch.cat(window))
    return torch.cat([layer.running_mean, layer.running_var, layer.num_batches_tracked.double().view(1)])


def bn_state(layer: nn.Module) -> Tensor:
    return torch.cat([layer.running_mean, layer.running_var, layer.num_batches_tracked.double().view(1)])


def windows(rank: int | None, upto: int = len(SIZES[0])) -> list[list[Tensor]]:
    """Each window's micro-batches (every rank's where ``rank`` is None), its first ``upto`` batches."""
    ranks = range(WORLD) if rank is None else [rank]
    return [[X[r][i] for r in ranks for i in range(s, min(s + K, upto))] for s in range(0, upto, K)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- the engine's object, on 2 ranks
def _ranks(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        report: dict[str, Any] = {}
        gathers = [0]
        all_gather = dist.all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            gathers[0] += 1
            return all_gather(*args, **kwargs)

        dist.all_gather = counted  # (this forked rank's own module)
        net = Net()
        stats = WindowBatchNorm()
        stats.attach(net)
        saved = None
        for i, x in enumerate(X[rank]):
            stats.arm()  # (a micro-batch: its forwards pooled till `accept`)
            net(x)
            stats.accept()
            if i == 4:  # inside the second window, after 2 of its micro-batches: every rank asks
                saved = stats.state_dict()
            if i % K == K - 1:
                stats.commit()
        report["gathers"] = gathers[0]  # (one per window, one for the checkpoint's state)
        report["sync"] = bn_state(net.sync).tolist()
        report["saved_count"] = saved["sync"]["count"] if saved else None
        # resumed from that checkpoint (rank 0's, as Lightning and Fabric write it): the second window ends alike
        resumed = Net()
        resumed.load_state_dict(net.state_dict())
        resumed.sync.load_state_dict(first_window_state())
        stats = WindowBatchNorm()
        stats.attach(resumed)
        stats.load_state_dict(broadcast(saved))
        stats.arm()
        resumed(X[rank][5])
        stats.accept()
        stats.commit()
        report["resumed"] = bn_state(resumed.sync).tolist()
        # a checkpoint written by one process (its SyncBatchNorm is plain there) resumed on 2 ranks
        one = {"sync": {"count": 10, "mean": torch.tensor([1.0, -2.0], dtype=torch.float64),
                        "m2": torch.tensor([9.0, 18.0], dtype=torch.float64)}}  # fmt: skip
        grown = Net()
        stats = WindowBatchNorm()
        stats.load_state_dict(one)  # (before attaching: kept till then)
        stats.attach(grown)
        stats.arm()
        grown(X[rank][0])
        stats.accept()
        stats.commit()
        report["grown"] = bn_state(grown.sync).tolist()
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def first_window_state() -> dict[str, Tensor]:
    layer = nn.BatchNorm1d(2).double()
    with torch.no_grad():
        layer(torch.cat(windows(None)[0]))
    return {k: v for k, v in layer.state_dict().items()}


def broadcast(state: Any) -> Any:
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def test_sync_batchnorm_pools_the_union_of_ranks_with_unequal_sizes(tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(
        _ranks, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method="fork", join=True
    )
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    union = reference(windows(None), 0.1)
    for report in reports:
        assert float((torch.tensor(report["sync"], dtype=torch.float64) - union).abs().max()) <= 1e-12
        assert float((torch.tensor(report["resumed"], dtype=torch.float64) - union).abs().max()) <= 1e-12
    assert reports[0]["saved_count"] == 4 + 4 + 3 + 3  # the union's 2 micro-batches, not rank 0's
    assert [r["gathers"] for r in reports] == [2 + 1] * WORLD  # 2 windows, 1 checkpoint: one all-gather each
    # one process's partial window (10 samples, mean (1, -2), m2 (9, 18)) and both ranks' first micro-batch
    x = torch.cat([X[0][0], X[1][0]])
    n = 10 + len(x)
    mean = (torch.tensor([1.0, -2.0], dtype=torch.float64) * 10 + x.sum(0)) / n
    m2 = torch.tensor([9.0, 18.0], dtype=torch.float64) + ((x - x.mean(0)) ** 2).sum(0)
    m2 += 10 * len(x) / n * (torch.tensor([1.0, -2.0], dtype=torch.float64) - x.mean(0)) ** 2
    expected = torch.cat([0.1 * mean, 0.9 + 0.1 * m2 / (n - 1), torch.ones(1, dtype=torch.float64)])
    for report in reports:
        assert float((torch.tensor(report["grown"], dtype=torch.float64) - expected).abs().max()) <= 1e-12


# ---------------------------------------------------------------------- the callback under DDP
class Pairs(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, rank: int) -> None:
        self.x, self.y = torch.cat(X[rank]), torch.cat(Y[rank])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class RankSizes(torch.utils.data.Sampler[list[int]]):
    """Each rank its own micro-batch sizes (``SIZES``)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        start = 0
        for n in SIZES[dist.get_rank()]:
            yield list(range(start, start + n))
            start += n

    def __len__(self) -> int:
        return len(SIZES[0])


class RankData(DataLoader[Any]):
    def __init__(self) -> None:
        super().__init__(Pairs(0), batch_sampler=RankSizes())

    def __iter__(self):  # type: ignore[no-untyped-def]
        for idx in RankSizes():
            data = Pairs(dist.get_rank())
            yield data.x[idx], data.y[idx]


class Model(pl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.net, self.out = Net(), out

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        report = {"sync": bn_state(self.net.sync).tolist(), "plain": bn_state(self.net.plain).tolist()}
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(report))


def fit_ranks(tmp_path: Path, model: Model, strategy: Any, precision: str = "64-true") -> list[dict[str, Any]]:
    t = trainer(
        callbacks=[AccumulationScheduler(K, batchnorm="window")],
        max_epochs=1,
        devices=WORLD,
        strategy=strategy,
        use_distributed_sampler=False,
        precision=precision,
    )
    t.fit(model, RankData())
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def check_union_and_own(reports: list[dict[str, Any]], rank1_plain: Tensor) -> None:
    """``SyncBatchNorm``: the union's on both ranks; plain BatchNorm: rank 0 its own, rank 1 ``rank1_plain``."""
    union = reference(windows(None), 0.1)
    for report in reports:
        assert float((torch.tensor(report["sync"], dtype=torch.float64) - union).abs().max()) <= 1e-12
    own = reference(windows(0), None)
    assert float((torch.tensor(reports[0]["plain"], dtype=torch.float64) - own).abs().max()) <= 1e-12
    assert float((torch.tensor(reports[1]["plain"], dtype=torch.float64) - rank1_plain).abs().max()) <= 1e-12


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_ddp_plain_batchnorm_and_broadcast_buffers(
    tmp_path: Path, broadcast_buffers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's DDP, ``SyncBatchNorm`` (the union's) beside a plain ``BatchNorm1d`` (each rank's own, rank 0's
    reaching rank 1 at the next forward with ``broadcast_buffers``)."""
    # (DDP refuses a SyncBatchNorm on a CPU module: the stand-in is one, so that the hooks take it as such)
    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "_passing_sync_batchnorm_handle", lambda *a: None)
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo", broadcast_buffers=broadcast_buffers)
    reports = fit_ranks(tmp_path, Model(tmp_path), strategy)
    own = reference(windows(1), None)
    if broadcast_buffers:  # rank 0's first window reached rank 1 at the second window's first forward
        after_first = nn.BatchNorm1d(2, momentum=None).double()
        with torch.no_grad():
            after_first(torch.cat(windows(0)[0]))
        expected = reference(windows(1)[1:], None, start=after_first)
        assert float((expected - own).abs().max()) > 1e-3  # (the two really differ)
    else:  # each rank its own
        expected = own
    check_union_and_own(reports, expected)


class ForkedModelParallel(ModelParallelStrategy):
    """FSDP2 over the ranks (a 1-D data-parallel mesh), the ranks forked (as ``test_fsdp2.py``)."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size=WORLD, tensor_parallel_size=1)

    def _configure_launcher(self) -> None:
        self._launcher = ChildLauncher(self, start_method="fork")


class ShardedModel(Model):
    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def test_fsdp2_sync_batchnorm_union_and_plain_batchnorm_per_rank(tmp_path: Path) -> None:
    """FSDP2 shards parameters, not buffers, and does not broadcast them: ``SyncBatchNorm`` the union's, plain
    BatchNorm each rank its own window statistics (exact, as under DDP with ``broadcast_buffers=False``)."""
    reports = fit_ranks(tmp_path, ShardedModel(tmp_path), ForkedModelParallel(), precision="32-true")
    check_union_and_own(reports, reference(windows(1), None))


# ---------------------------------------------------------------------- plain BatchNorm's "rank 0's statistics"
SAVE_AT = 4  # (the batch after which every rank saves: inside the second window, after 2 of its micro-batches)


class ResumableRankData(RankData):
    """``RankData`` that resumes after the batches Lightning processed (its state in the checkpoint)."""

    trainer: pl.Trainer | None = None
    skip = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        assert self.trainer is not None
        return {"consumed": self.trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["consumed"]


class SaveInside(pl.Callback):
    def __init__(self, path: Path | None, data: ResumableRankData) -> None:
        self.path, self.data = path, data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.data.trainer = trainer

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.path is not None and trainer.fit_loop.epoch_loop.batch_idx == SAVE_AT:
            trainer.save_checkpoint(self.path)  # (every rank: the `SyncBatchNorm` union is gathered; rank 0 writes)


def test_ddp_plain_batchnorm_is_rank_0s_in_the_checkpoint_and_after_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's "rank 0's statistics" under DDP with ``broadcast_buffers=True``: the checkpoint rank 0 writes
    inside a window holds rank 0's last window's statistics (and rank 0's part of the open window's); resumed on 2
    ranks, rank 0 ends with the statistics of its own windows (the uninterrupted fit's), and rank 1, which loaded
    rank 0's part of the open window, with rank 0's closed window updated by that part and its own micro-batch after
    it. ``SyncBatchNorm`` beside it ends with the union's. Against the float64 single-batch updates by hand."""
    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "_passing_sync_batchnorm_handle", lambda *a: None)
    path = tmp_path / "inside.ckpt"

    def fit(save: Path | None, resume: Path | None) -> list[dict[str, Any]]:
        data = ResumableRankData()
        t = trainer(
            callbacks=[AccumulationScheduler(K, batchnorm="window"), SaveInside(save, data)], max_epochs=1,
            devices=WORLD, use_distributed_sampler=False, precision="64-true",
            strategy=DDPStrategy(start_method="fork", process_group_backend="gloo", broadcast_buffers=True),
        )  # fmt: skip
        t.fit(Model(tmp_path), data, ckpt_path=resume)
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    full = fit(path, None)
    saved = torch.load(path, weights_only=False)["state_dict"]
    first = reference(windows(0)[:1], None)  # rank 0's first window, and the last closed when the checkpoint is written
    in_file = torch.cat([saved[f"net.plain.{b}"].double().view(-1) for b in ("running_mean", "running_var")])
    assert float((in_file - first[:-1]).abs().max()) <= 1e-12 and int(saved["net.plain.num_batches_tracked"]) == 1
    resumed = fit(None, path)
    own = reference(windows(0), None)
    start = nn.BatchNorm1d(2, momentum=None).double()
    with torch.no_grad():
        start(torch.cat(windows(0)[0]))
    loaded_part = reference([[X[0][3], X[0][4], X[1][5]]], None, start=start)  # rank 0's part, rank 1's rest
    union = reference(windows(None), 0.1)
    for run in (full, resumed):
        assert float((torch.tensor(run[0]["plain"], dtype=torch.float64) - own).abs().max()) <= 1e-12
        for report in run:
            assert float((torch.tensor(report["sync"], dtype=torch.float64) - union).abs().max()) <= 1e-12
    assert float((torch.tensor(resumed[1]["plain"], dtype=torch.float64) - loaded_part).abs().max()) <= 1e-12
    assert float((loaded_part - own).abs().max()) > 1e-3  # (rank 1's differs: till its next forward)
