"""``Budget`` under DDP: 2 forked gloo ranks whose micro-batches hold different token counts close the same
windows, equal to the float64 reference over both ranks and to one process on the union of their micro-batches,
with exactly one host collective (one integer, on the host) added per micro-batch."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.strategies import DDPStrategy
from test_budget import reference
from test_fabric_fsdp2 import DATA as FSDP2_DATA
from test_fabric_fsdp2 import SCATTERS, SHARDED_LAYERS, ForkedModelParallel
from test_fabric_fsdp2 import train as fsdp2_train

from lightning_accum import AccumulationScheduler, Budget
from lightning_accum._trainer import fit_checks

from helpers import (
    KRecorder,
    ManualTokenModel,
    TokenData,
    TokenModel,
    count_tokens,
    default_dtype,
    loader,
    max_diff,
    rank_batches,
)
from helpers import trainer as make_trainer

pytestmark = pytest.mark.slow

WORLD = 2
HOST_SUMS = [0]  # per process: the budget's all-reduces (one int64 on the host)
ALL = [0]  # per process: every `torch.distributed.all_reduce`


class Report(pl.Callback):
    def __init__(self, out: Path, recorder: KRecorder) -> None:
        self.out, self.recorder = out, recorder

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        original = dist.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            ALL[0] += 1
            if sys._getframe(1).f_code.co_name == "host_sum":  # (the budget's: one int64 on the host)
                assert tensor.device.type == "cpu" and tensor.numel() == 1
                HOST_SUMS[0] += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting  # (in this forked rank only)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accum = next((cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)), None)  # type: ignore[attr-defined]
        progress = pl_module.accumulation_progress if accum is None else accum.progress  # type: ignore[attr-defined]
        report = {
            "params": [p.detach().tolist() for p in pl_module.parameters()],
            "windows": self.recorder.windows,
            "host_sums": HOST_SUMS[0],
            "all": ALL[0],
            "progress": progress.__dict__,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def fit_ddp(tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback]) -> list[dict[str, Any]]:
    recorder = KRecorder()
    t = make_trainer(
        callbacks=[*callbacks, recorder, Report(tmp_path, recorder)],
        devices=WORLD,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
        use_distributed_sampler=False,
    )
    t.fit(model, loader(TokenData(64), 4, sharded=True))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def expected(n: int) -> tuple[list[torch.Tensor], list[int]]:
    ranks = rank_batches(TokenData(64), 4, world=WORLD)
    per_rank = [sum(int(b["mask"].sum()) for b in r) for r in ranks]
    assert per_rank[0] != per_rank[1]  # the ranks really differ in token count
    params, sizes, _ = reference([ranks] * 2, lambda p: n)
    # one process whose micro-batch i is the union of the ranks' i-th: the same windows and gradient
    union = [{key: torch.cat([a[key], b[key]]) for key in a} for a, b in zip(*ranks, strict=True)]
    one, one_sizes, _ = reference([[union]] * 2, lambda p: n)
    assert one_sizes == sizes and max_diff(one, params) <= 1e-12
    return params, sizes


@pytest.mark.parametrize("adapter", ["callback", "callback+pieces", "mixin"])
def test_ranks_close_the_same_windows_as_one_process_on_the_union(tmp_path: Path, adapter: str) -> None:
    budget = Budget(50, unit="items")
    if adapter.startswith("callback"):
        size = 3 if adapter == "callback+pieces" else None  # (each loader batch of 4 in pieces of 3 and 1)
        callback = AccumulationScheduler(
            budget, normalize="items", count=count_tokens, reduction="sum", microbatch_size=size
        )
        reports = fit_ddp(tmp_path, TokenModel(reduction="sum"), [callback])
    else:
        model = ManualTokenModel(reduction="sum", schedule=budget, normalize="items", count=count_tokens)
        reports = fit_ddp(tmp_path, model, [])
    params, sizes = expected(50)
    assert len(set(sizes)) > 1  # (windows of different sizes)
    microbatches = sum(sizes)
    for report in reports:
        assert max_diff([torch.tensor(p, dtype=torch.float64) for p in report["params"]], params) <= 1e-12
        if adapter == "callback":
            assert report["windows"] == sizes
        assert report["host_sums"] == microbatches  # one host collective per micro-batch
    assert reports[0]["progress"] == reports[1]["progress"]
    assert reports[0]["progress"]["step"] == len(sizes)


def fsdp2_ranks(fabric: Fabric, out: Path) -> None:
    torch.set_default_dtype(torch.float64)
    options = {"normalize": "items", "reduction": "sum", "count": count_tokens}
    params, scatters, steps = fsdp2_train(fabric, Budget(60, unit="items"), options, last=True)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps([params, scatters, steps]))


def test_fsdp2_in_a_fabric_loop_equals_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's last micro-batch is known before its backward (its count over ranks): one reduce-scatter round
    per window, as under a schedule of k."""
    original = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        SCATTERS[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "reduce_scatter_single", counting)  # before the fork: the ranks inherit it
    strategy = ForkedModelParallel()
    Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true").launch(fsdp2_ranks, tmp_path)
    with default_dtype(torch.float64):  # (the ranks' model was made under float64 defaults)
        expected, sizes, _ = reference(
            [rank_batches(FSDP2_DATA, 4, world=WORLD)] * 2, lambda p: 60, optimizer="plain-sgd"
        )
    assert len(set(sizes)) > 1
    for rank in range(WORLD):
        params, scatters, steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max_diff([torch.tensor(p, dtype=torch.float64) for p in params], expected) <= 1e-12
        assert steps == len(sizes)
        assert scatters == SHARDED_LAYERS * len(sizes)


# ------------------------------------------------------------------ a rank whose data runs out first
def recording(out: Path) -> Any:
    """``refuse_uneven_budget_data`` that writes, on each rank, what it raised and the steps taken (a rank runs in a
    child process, where Lightning's launcher calls no ``on_exception``)."""
    check = fit_checks.refuse_uneven_budget_data

    def wrapped(trainer: pl.Trainer, schedule: object, owner: str) -> None:
        try:
            check(trainer, schedule, owner)
        except RuntimeError as error:
            report = {"error": str(error), "step": trainer.global_step}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
            raise

    return wrapped


@pytest.mark.parametrize("adapter", ["callback", "mixin"])
def test_a_rank_whose_loader_runs_out_first_is_refused_on_every_rank_at_the_start(
    tmp_path: Path, adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """33 samples over 2 ranks in batches of 4: rank 0's loader holds 5 batches, rank 1's 4. Under a budget every
    micro-batch's count is summed over the ranks, so rank 1's epoch would end while rank 0 waits in the count of its
    fifth (rank 1 ended the fit as if nothing were wrong, and rank 0 failed on a closed connection, or waited for the
    process group's timeout). Every rank raises at the fit's start, before any step, naming the lengths and the fix.
    (The process group's timeout is short here, so that a rank left waiting fails the test rather than holds it.)"""
    monkeypatch.setattr(fit_checks, "refuse_uneven_budget_data", recording(tmp_path))  # (before the fork)
    budget = Budget(16, unit="samples")
    if adapter == "callback":
        model: pl.LightningModule = TokenModel()
        callbacks: list[pl.Callback] = [AccumulationScheduler(budget)]
    else:
        model, callbacks = ManualTokenModel(schedule=budget), []
    t = make_trainer(
        callbacks=callbacks, devices=WORLD, use_distributed_sampler=False,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo", timeout=timedelta(seconds=30)),
    )  # fmt: skip
    with pytest.raises(Exception, match=r"training loaders hold \[5, 4\] batches"):
        t.fit(model, loader(TokenData(33), 4, sharded=True))
    owner = "AccumulationScheduler" if adapter == "callback" else "configure_accumulation"
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["step"] == 0
        assert report["error"].startswith(f"`{owner}(Budget(16, unit='samples'))` needs every rank to run the same")
        assert "limit_train_batches=4" in report["error"]
